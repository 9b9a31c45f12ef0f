"""Per-namespace hit counters, which the lookups bump under the store's lock.

Owns: `NamespaceHits` (one per namespace: `StoreStats.namespaces[ns]`, beside its description;
the whole store's counters are `hpkv.stats.StoreCounters` itself). Field names are stats keys.
Must not know: the lock, the tiers, or who reads the stats.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NamespaceHits:
    lookups: int = 0
    lookup_keys: int = 0
    hit_keys_dram: int = 0
    hit_keys_storage: int = 0

    def count(self, num_keys: int, num_dram: int, num_storage: int) -> None:
        """One lookup of `num_keys` keys, whose leading hits were in DRAM and on storage."""
        self.lookups += 1
        self.lookup_keys += num_keys
        self.hit_keys_dram += num_dram
        self.hit_keys_storage += num_storage
