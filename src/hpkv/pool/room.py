"""How the DRAM tier finds room for a new entry when no slab is free: a policy given to the tier.

Owns: `RoomPolicy` (what a policy is), `OldestFirst` (the tier's own: the oldest evictable entry
goes, or, when another size class holds older ones, that class's movable slab with the oldest
entry moves over) and `WalkOldest` (the same choice made by walking entries oldest first: the
reference the fast one must match, for tests and `bench/reserve_contention.py`).
Primitives, the tier's (`DramTier`) and its evictable entries' (`tier.lru`, `pool/lru.py`):
`lru.by_class()`, `lru.oldest_movable(slot_bytes)`, `slab_entries(slab)`, `move_slab(slab, slot_bytes)`,
`evict_for(entry, slot_bytes)`.
Must not know: the store, leases, reservations, or what an entry holds. Runs under the caller's
lock: its cost is what every other client of the store waits for.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .tier import DramEntry, DramTier


class RoomPolicy(Protocol):
    def make_room(self, tier: DramTier, slot_bytes: int) -> int | None:
        """A free slot of `slot_bytes` made by evicting, or None where nothing may go."""


def oldest(tier: DramTier, slot_bytes: int) -> DramEntry | None:
    """The class's least recently used evictable entry."""
    own = tier.lru.by_class().get(slot_bytes)
    return next(iter(own)) if own else None


class OldestFirst:
    """O(log slabs): the tier keeps each class's movable slabs in a heap by their oldest entry."""

    def make_room(self, tier: DramTier, slot_bytes: int) -> int | None:
        own_oldest = oldest(tier, slot_bytes)
        best = tier.lru.oldest_movable(slot_bytes)
        if best is not None and (own_oldest is None or best[0] < own_oldest.stamp):
            return tier.move_slab(best[1], slot_bytes)
        if own_oldest is None:
            return None
        return tier.evict_for(own_oldest, slot_bytes)


class WalkOldest:
    """The reference, spelt out: walk the other classes' evictable entries oldest first, up to
    the class's own oldest; move the first slab whose entries are all evictable; else evict the
    class's own oldest entry. Every step is a walk over entries."""

    def make_room(self, tier: DramTier, slot_bytes: int) -> int | None:
        own_oldest = oldest(tier, slot_bytes)
        lrus = [lru for size, lru in tier.lru.by_class().items() if size != slot_bytes and lru]
        tried: set[int] = set()
        for other in heapq.merge(*lrus, key=lambda e: e.stamp):
            if own_oldest is not None and own_oldest.stamp < other.stamp:
                break
            slab = tier.alloc.slab_of(other.offset)
            if slab in tried:
                continue
            tried.add(slab)
            if all(e.evictable for e in tier.slab_entries(slab)):
                return tier.move_slab(slab, slot_bytes)
        if own_oldest is None:
            return None
        return tier.evict_for(own_oldest, slot_bytes)
