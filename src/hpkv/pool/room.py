"""How the DRAM tier finds room for a new entry when no slab is free: a policy given to the tier.

Owns: `RoomPolicy` (what a policy is), `Evictions` (what a policy may ask of the tier and tell
it: the narrow view the tier gives it), `OldestFirst` (the tier's own: the oldest evictable entry
goes, or, when another size class holds older ones, that class's movable slab with the oldest
entry moves over) and `WalkOldest` (the same choice made by walking entries oldest first: the
reference the fast one must match, for tests and `bench/reserve_contention.py`).
Primitives, through `Evictions`: `lru.by_class()`, `lru.oldest_movable(slot_bytes)` (the tier's
evictable entries, `pool/lru.py`), `alloc.slab_of`, `slab_entries(slab)`,
`move_slab(slab, slot_bytes)`, `evict_for(entry, slot_bytes)`.
Must not know: the tier's index, the store, leases, reservations, or what an entry holds. Runs
under the caller's lock: its cost is what every other client of the store waits for.
"""

from __future__ import annotations

import heapq
from typing import Protocol

from .entry import DramEntry
from .lru import EvictableEntries
from .slots import SlotAllocator


class Evictions(Protocol):
    """What a room policy may ask of the DRAM tier (`DramTier` is one) and tell it."""

    @property
    def lru(self) -> EvictableEntries: ...

    @property
    def alloc(self) -> SlotAllocator: ...

    def slab_entries(self, slab: int) -> list[DramEntry]:
        """The entries whose slots are in `slab`."""

    def move_slab(self, slab: int, slot_bytes: int) -> int | None:
        """Evict every entry of `slab` (all evictable); a slot of it, moved to `slot_bytes`."""

    def evict_for(self, entry: DramEntry, slot_bytes: int) -> int | None:
        """Evict `entry` (evictable, of the class); a slot of the class."""


class RoomPolicy(Protocol):
    def make_room(self, tier: Evictions, slot_bytes: int) -> int | None:
        """A free slot of `slot_bytes` made by evicting, or None where nothing may go."""


def oldest(tier: Evictions, slot_bytes: int) -> DramEntry | None:
    """The class's least recently used evictable entry."""
    own = tier.lru.by_class().get(slot_bytes)
    return next(iter(own)) if own else None


class OldestFirst:
    """O(log slabs): the tier keeps each class's movable slabs in a heap by their oldest entry."""

    def make_room(self, tier: Evictions, slot_bytes: int) -> int | None:
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

    def make_room(self, tier: Evictions, slot_bytes: int) -> int | None:
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
