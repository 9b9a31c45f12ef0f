"""Which namespaces' tier changes are journaled, and the tiers' hooks that feed the journal.

The store's part behind the protocol's `Journal` (KV events): a client `watch`es a namespace,
reads its records (`read`), asks which tiers hold some keys (`held`); when it goes
(`drop_owner`) the namespaces only it watched stop being journaled. The DRAM tier's and the
storage index's hooks are set while any namespace is watched and unset when none is, so that
with no engine publishing KV events nothing runs per entry. Engines' descriptions of their blocks
(`descriptions.Descriptions`) are kept here beside the journal, watched or not: `describe` keeps
them, `snapshot` pages through those of keys a tier holds, and a read of the journal drops those
of keys it saw leave a tier that no tier holds any more.
Primitives: `journal` (`journal.TierJournal`), `descriptions`, `watch`, `read`, `held`,
`describe`, `snapshot`, `drop_owner`.
Must not know: the protocol, clients beyond their owner ids.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ..pool.dram_tier import DramTier
from ..storage.storage_tier import StorageTier
from ..tiers import Tier
from .descriptions import DescribedPage, Descriptions
from .journal import STORED, Page, TierJournal
from .lookup import Lookups


class Watches:
    def __init__(self, dram: DramTier, storage: StorageTier | None, lookups: Lookups) -> None:
        self.journal = TierJournal()
        self.descriptions = Descriptions()
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
        """The records of `ns` past number `after` (None: `ns` is not journaled). The descriptions
        of keys they say left a tier, and that no tier holds now, are dropped."""
        page = self.journal.read(ns, after, max_records)
        if page is not None:
            left = self.descriptions.has(ns, [key for code, key in zip(page.codes, page.keys) if not code & STORED])
            if left:
                self.descriptions.drop(ns, [key for key, bits in zip(left, self.held(ns, left)) if not bits])
        return page

    def held(self, ns: str, keys: Sequence[bytes]) -> bytes:
        """Per key, the tiers holding it as bits (`Tier` values or-ed; 0: neither)."""
        return self._lookups.held_each(ns, keys)

    def describe(self, ns: str, keys: Sequence[bytes], blobs: Sequence[bytes]) -> int:
        """Keep an engine's descriptions of `keys` (`descriptions.Descriptions.put`)."""
        return self.descriptions.put(ns, keys, blobs)

    def snapshot(
        self, ns: str, after: int, held_in: Sequence[str], max_count: int, max_bytes: int
    ) -> tuple[DescribedPage, list[bytes]]:
        """The descriptions of `ns` numbered past `after` whose keys a tier holds in some namespace
        of `held_in`, and per namespace of `held_in` the tiers holding each (bits, as `held`)."""
        page = self.descriptions.page(ns, after, max_count, max_bytes)
        bits = [self.held(other, page.keys) for other in held_in]
        live = [i for i in range(len(page.keys)) if any(held[i] for held in bits)]
        held = [bytes(held[i] for i in live) for held in bits]
        return DescribedPage([page.keys[i] for i in live], [page.blobs[i] for i in live], page.last, page.more), held

    def drop_owner(self, owner: int) -> None:
        with self._lock:
            self.journal.unwatch_owner(owner)
            if not self.journal.watched:
                self._dram.changes = None
                if self._storage is not None:
                    self._storage.watch(None)
