"""The store's namespaces and its lookups: which leading keys of a prefix hit, and in which tier.

Owns: the namespaces registered (`NamespaceDesc` and `NamespaceHits` of each); the walk of a
prefix through the DRAM index and the storage index (DRAM before storage, stopping at the first
miss); the `stat` that looks for a file no index holds (another node's, or one the start-up scan
has not reached), always made without the store's lock.
Primitives: `register`, `known`, `descs`, `lookup`, `probe(ns)`, `found_elsewhere`, `stats`.
Must not know: leases, reservations, write-throughs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from ..keys import NamespaceDesc
from ..pool.tier import DramTier
from ..stats import NamespaceStats, StoreCounters
from ..storage.tier import StorageTier
from ..types import Lookup, Tier
from .counters import NamespaceHits

Probe = tuple[bytes, Callable[[bytes], bool]]  # the storage tier's `index_probe(ns)`
NOWHERE: Probe = (b"", frozenset().__contains__)  # the storage index of a store without a storage tier


class Lookups:
    def __init__(
        self, lock: threading.Lock, dram: DramTier, storage: StorageTier | None, counters: StoreCounters
    ) -> None:
        self._lock = lock
        self._dram = dram
        self._storage = storage
        self._counters = counters
        self._descs: dict[str, NamespaceDesc] = {}
        self._hits: dict[str, NamespaceHits] = {}

    def register(self, desc: NamespaceDesc) -> str:
        """The namespace of `desc`, known from now on; PoolError where the DRAM tier refuses it
        (an entry larger than a slab), and then nothing is written anywhere."""
        ns = desc.ns
        with self._lock:
            known = ns in self._descs
            if not known:
                self._dram.add_namespace(ns, desc.entry_bytes)  # refuses first: a refused ns leaves no file
        if not known and self._storage is not None:
            # File I/O (a hung network file system) outside the lock, which every client needs;
            # idempotent, so two engines registering at once both may.
            self._storage.add_namespace(ns, desc.to_json())
        with self._lock:
            if ns not in self._descs:
                self._descs[ns] = desc
                self._hits[ns] = NamespaceHits()
        return ns

    def known(self, ns: str) -> bool:
        return ns in self._descs

    def descs(self) -> dict[str, NamespaceDesc]:
        return dict(self._descs)

    def probe(self, ns: str) -> Probe:
        return self._storage.index_probe(ns) if self._storage is not None else NOWHERE

    def lookup(self, ns: str, keys: Sequence[bytes]) -> Lookup:
        tiers: list[Tier] = []
        index = self._dram.index_of(ns)
        prefix, on_storage = self.probe(ns)
        while True:
            with self._lock:
                for key in keys[len(tiers) :] if tiers else keys:
                    entry = index.get(key)
                    if entry is not None and entry.ready:
                        tiers.append(Tier.DRAM)
                    elif on_storage(prefix + key):
                        tiers.append(Tier.STORAGE)
                    else:
                        break
            if not self.found_elsewhere(ns, keys, len(tiers)):
                break
        num_dram = tiers.count(Tier.DRAM)
        with self._lock:
            c = self._counters
            c.lookups += 1
            c.lookup_keys += len(keys)
            c.hit_keys_dram += num_dram
            c.hit_keys_storage += len(tiers) - num_dram
            self._hits[ns].count(len(keys), num_dram, len(tiers) - num_dram)
        return Lookup(tuple(tiers))

    def found_elsewhere(self, ns: str, keys: Sequence[bytes], i: int) -> bool:
        """Whether keys[i], where a walk of the indexes stopped, has a file on storage after all
        (another node wrote it, or the start-up scan has not reached it): the tier adopts it, and
        the walk goes on from there. Called without the lock: a `stat` on a network file system
        is a round trip (or a hang), which under the lock would hold up every client."""
        if self._storage is None or i >= len(keys):
            return False
        key = keys[i]
        if self._dram.get(ns, key) is not None or self._storage.indexed(ns, key):
            return False  # the walk stopped for another reason (an entry still being written, say)
        return self._storage.contains(ns, key)

    def stats(self) -> dict[str, NamespaceStats]:
        """Per namespace: its description and hit counters. Caller holds the lock."""
        return {ns: NamespaceStats(desc=desc.to_json(), **vars(self._hits[ns])) for ns, desc in self._descs.items()}
