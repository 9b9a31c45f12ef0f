"""Which namespaces' tier changes are journaled, and the tiers' hooks that feed the journal.

The store's part behind the protocol's `Journal` (KV events): a client `watch`es a namespace,
reads its records (`read`), asks which tiers hold some keys (`held`); when it goes
(`drop_owner`) the namespaces only it watched stop being journaled. The DRAM tier's and the
storage index's hooks are set while any namespace is watched and unset when none is, so that
with no engine publishing KV events nothing runs per entry.
Primitives: `journal` (`journal.TierJournal`), `watch`, `read`, `held`, `drop_owner`.
Must not know: the protocol, clients beyond their owner ids.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ..pool.dram_tier import DramTier
from ..storage.storage_tier import StorageTier
from ..tiers import Tier
from .journal import Page, TierJournal
from .lookup import Lookups


class Watches:
    def __init__(self, dram: DramTier, storage: StorageTier | None, lookups: Lookups) -> None:
        self.journal = TierJournal()
        self._dram = dram
        self._storage = storage
        self._lookups = lookups
        self._lock = threading.Lock()  # hooks and watchers change together

    def watch(self, ns: str, owner: int) -> int:
        """Journal what enters and leaves each tier of `ns` while `owner` watches it; the number
        of its last record, from which `read` reads on."""
        with self._lock:  # hooks first: every change after the number returned is recorded
            self._dram.changes = self.journal.recorder(Tier.DRAM)
            if self._storage is not None:
                self._storage.watch(self.journal.recorder(Tier.STORAGE))
            return self.journal.watch(ns, owner)

    def read(self, ns: str, after: int, max_records: int) -> Page | None:
        """The records of `ns` past number `after` (None: `ns` is not journaled)."""
        return self.journal.read(ns, after, max_records)

    def held(self, ns: str, keys: Sequence[bytes]) -> bytes:
        """Per key, the tiers holding it as bits (`Tier` values or-ed; 0: neither)."""
        return self._lookups.held_each(ns, keys)

    def drop_owner(self, owner: int) -> None:
        with self._lock:
            self.journal.unwatch_owner(owner)
            if not self.journal.watched:
                self._dram.changes = None
                if self._storage is not None:
                    self._storage.watch(None)
