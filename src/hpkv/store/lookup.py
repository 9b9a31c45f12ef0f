"""The store's namespaces and its lookups: which leading keys of a prefix hit, and in which tier.

Owns: the namespaces registered (`NamespaceDesc` and `NamespaceHits` of each), who holds them
and the limits on them (`owners.NamespaceOwners`): a namespace no owner holds and with no entry in
DRAM is forgotten (its storage index number may go, its files stay), when its last owner goes or
when the store is at its limit; the walk of a
prefix through the DRAM index and the storage index (DRAM before storage, stopping at the first
miss); the `stat` that looks for a file no index holds (another node's, or one the start-up scan
has not reached), always made without the store's lock.
Primitives: `register`, `drop_owner`, `known`, `descs`, `lookup`, `lookup_each`, `held_each`, `probe(ns)`,
`found_elsewhere`, `stats`, `summary`.
Must not know: leases, reservations, write-throughs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from ..keys import NamespaceDesc
from ..pool.dram_tier import DramTier
from ..stats import NamespaceHits, NamespaceStats, NamespaceSummary, StoreCounters
from ..storage.storage_tier import StorageTier
from ..tiers import Lookup, Tier
from .owners import NamespaceOwners

Probe = tuple[bytes, Callable[[bytes], bool]]  # the storage tier's `index_probe(ns)`
NOWHERE: Probe = (b"", frozenset().__contains__)  # the storage index of a store without a storage tier
_DRAM, _STORAGE = int(Tier.DRAM), int(Tier.STORAGE)


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
        self.owners = NamespaceOwners()
        # The cluster tier's hook (`store.cluster.ClusterLink.fill`, set by the store): reads
        # the keys after the leading DRAM hits from the cluster into DRAM, before the walk.
        self.fill: Callable[[str, Sequence[bytes]], int] = lambda ns, keys: 0

    def register(self, desc: NamespaceDesc, owner: int = 0, uid: int | None = None) -> str:
        """The namespace of `desc`, known from now on and held by `owner` (of `uid`; None: in
        process) until `drop_owner`; `owners.NamespaceLimit` past a limit, PoolError where the DRAM
        tier refuses it (an entry larger than a slab), and then nothing is written anywhere."""
        ns = desc.ns
        desc_json = desc.to_json()
        with self._lock:
            self.owners.check(ns, len(desc_json.encode()), owner, uid)
            known = ns in self._descs
            if not known:
                limit = self.owners.limits.max_total
                if limit is not None and len(self._descs) >= limit and not self._make_room(limit):
                    self.owners.refuse_total(len(self._descs))
                self._dram.add_namespace(ns, desc.entry_bytes)  # refuses first: a refused ns leaves no file
                self._descs[ns] = desc
                self._hits[ns] = NamespaceHits()
                if self._storage is not None:
                    self._storage.pin_namespace(ns)
            self.owners.add(ns, owner, uid)
        if not known and self._storage is not None:
            # File I/O (a hung network file system) outside the lock, which every client needs;
            # idempotent, so two engines registering at once both may.
            self._storage.add_namespace(ns, desc_json)
        return ns

    def drop_owner(self, owner: int) -> None:
        """`owner` is gone: forget the namespaces it held that no other owner holds and that have
        no entry in DRAM. Caller holds the lock."""
        for ns in self.owners.drop_owner(owner):
            self._forget(ns)

    def _make_room(self, limit: int) -> bool:
        """Forget namespaces no owner holds to get under `limit`: those with no entry in DRAM,
        then, if that is not enough, those whose entries can be dropped (their files stay).
        Caller holds the lock."""
        unheld = [ns for ns in self._descs if not self.owners.held(ns)]
        for ns in unheld:
            self._forget(ns)
        for ns in unheld:
            if len(self._descs) < limit:
                break
            if ns in self._descs:
                self._dram.drop(ns)
                self._forget(ns)
        return len(self._descs) < limit

    def _forget(self, ns: str) -> None:
        """Forget `ns` if DRAM holds no entry of it. Caller holds the lock."""
        if self._dram.remove_namespace(ns):
            del self._descs[ns]
            del self._hits[ns]
            if self._storage is not None:
                self._storage.pin_namespace(ns, pinned=False)

    def known(self, ns: str) -> bool:
        return ns in self._descs

    def descs(self) -> Mapping[str, NamespaceDesc]:
        """A read-only view of the namespaces registered (no copy)."""
        return MappingProxyType(self._descs)

    def probe(self, ns: str) -> Probe:
        return self._storage.index_probe(ns) if self._storage is not None else NOWHERE

    def lookup(self, ns: str, keys: Sequence[bytes]) -> Lookup:
        self.fill(ns, keys)  # without the lock: a round trip to the cluster
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

    def held_each(self, ns: str, keys: Sequence[bytes]) -> bytes:
        """Per key, the tiers whose indexes hold it, as bits (DRAM 1, storage 2; 0: neither): what
        an engine publishing KV events learns again after its journal records were lost."""
        index = self._dram.index_of(ns)
        prefix, on_storage = self.probe(ns)
        held = bytearray(len(keys))
        with self._lock:
            for i, key in enumerate(keys):
                entry = index.get(key)
                in_dram = entry is not None and entry.ready
                held[i] = (_DRAM if in_dram else 0) | (_STORAGE if on_storage(prefix + key) else 0)
        return bytes(held)

    def lookup_each(self, ns: str, keys: Sequence[bytes]) -> bytes:
        """The tier of every key (`Tier` codes, 0 for a miss), past misses too: for entries kept at
        some positions only (a hybrid model's states at some block boundaries). Only the indexes
        are asked (no `stat` per missing key): a file another node wrote that no index holds yet
        is a miss here."""
        index = self._dram.index_of(ns)
        prefix, on_storage = self.probe(ns)
        tiers = bytearray(len(keys))
        with self._lock:
            for i, key in enumerate(keys):
                entry = index.get(key)
                if entry is not None and entry.ready:
                    tiers[i] = _DRAM
                elif on_storage(prefix + key):
                    tiers[i] = _STORAGE
            num_dram, num_storage = tiers.count(_DRAM), tiers.count(_STORAGE)
            c = self._counters
            c.lookups += 1
            c.lookup_keys += len(keys)
            c.hit_keys_dram += num_dram
            c.hit_keys_storage += num_storage
            self._hits[ns].count(len(keys), num_dram, num_storage)
        return bytes(tiers)

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

    def summary(self) -> NamespaceSummary:
        """Caller holds the lock."""
        limits = self.owners.limits
        return NamespaceSummary(
            total=len(self._descs),
            held=sum(self.owners.held(ns) for ns in self._descs),
            refused=self.owners.refused,
            max_desc_bytes=limits.max_desc_bytes,
            max_per_uid=limits.max_per_uid,
            max_total=limits.max_total,
        )

    def stats(self) -> dict[str, NamespaceStats]:
        """Per namespace: its description and hit counters. Caller holds the lock."""
        return {ns: NamespaceStats(desc=desc.to_json(), **vars(self._hits[ns])) for ns, desc in self._descs.items()}
