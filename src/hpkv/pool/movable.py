"""The DRAM tier's books of slabs that could move to another size class: kept so that finding
one costs O(log slabs) under the store's lock, whatever the pool holds.

Owns: per slab, its evictable entries in LRU order (stamp order); per size class, a heap of
(stamp of the oldest entry, slab) of its slabs whose entries were all evictable when pushed (an
item is stale once its slab's oldest entry has another stamp, and is skipped when met), and the
stamp each slab was offered with, kept from the time a second size class appears.
Primitives, told by the evictable entries (`lru.py`): `start`, `added`, `removed`, `touched`,
`freed`, `drain`; asked by room policies through them: `oldest_movable`.
Must not know: the index, pins beyond "evictable", or which policy asks.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable

from .entry import DramEntry
from .slots import SlotAllocator


class MovableSlabs:
    def __init__(self, alloc: SlotAllocator, lrus: Iterable[OrderedDict[DramEntry, None]]) -> None:
        """Sort the evictable entries by slab (each class's LRU is in stamp order: so is each
        slab's, a slab serving one class) and offer every slab."""
        self._alloc = alloc
        self._slab_lru: dict[int, OrderedDict[DramEntry, None]] = {}
        self._movable: dict[int, list[tuple[int, int]]] = {}  # slot_bytes -> heap
        self._offered: dict[int, int] = {}  # slab -> the stamp of its item in the heap
        for lru in lrus:
            for entry in lru:
                self._slab_lru.setdefault(alloc.slab_of(entry.offset), OrderedDict())[entry] = None
        for slab in list(self._slab_lru):
            self._offer(slab)

    def added(self, entry: DramEntry) -> None:
        """`entry` is evictable now, the most recently used."""
        slab = self._alloc.slab_of(entry.offset)
        slab_lru = self._slab_lru.setdefault(slab, OrderedDict())
        slab_lru[entry] = None
        slab_lru.move_to_end(entry)
        self._offer(slab)

    def removed(self, entry: DramEntry) -> None:
        """`entry` is evictable no more (pinned)."""
        self._slab_lru[self._alloc.slab_of(entry.offset)].pop(entry, None)

    def touched(self, entry: DramEntry) -> None:
        """`entry`, evictable, is the most recently used now."""
        slab = self._alloc.slab_of(entry.offset)
        slab_lru = self._slab_lru[slab]
        was_oldest = next(iter(slab_lru)) is entry
        slab_lru.move_to_end(entry)
        if was_oldest:
            self._offer(slab)

    def freed(self, entry: DramEntry) -> None:
        """`entry`'s slot was given back to the allocator."""
        slab = self._alloc.slab_of(entry.offset)
        slab_lru = self._slab_lru.get(slab)
        if slab_lru is not None:
            slab_lru.pop(entry, None)
        if not self._alloc.num_used_in_slab(slab):
            self._slab_lru.pop(slab, None)
            self._offered.pop(slab, None)
        else:
            self._offer(slab)

    def drain(self, slab: int) -> OrderedDict[DramEntry, None]:
        """The entries of a slab that moves (all evictable), out of these books."""
        self._offered.pop(slab, None)
        return self._slab_lru.pop(slab)

    def oldest_movable(self, slot_bytes: int) -> tuple[int, int] | None:
        """(stamp, slab) of the slab of another class than `slot_bytes` whose entries are all
        evictable and whose oldest entry is the oldest of such slabs."""
        best: tuple[int, int] | None = None
        for other in self._movable:
            if other != slot_bytes:
                top = self._oldest_of_class(other)
                if top is not None and (best is None or top < best):
                    best = top
        return best

    def _movable_now(self, slab: int) -> DramEntry | None:
        """The oldest entry of a slab whose entries are all evictable (None if one is not)."""
        slab_lru = self._slab_lru.get(slab)
        if not slab_lru or len(slab_lru) != self._alloc.num_used_in_slab(slab):
            return None
        return next(iter(slab_lru))

    def _offer(self, slab: int) -> None:
        """Push the slab on its class's heap if it may move now (and is not there as it is)."""
        oldest = self._movable_now(slab)
        if oldest is None or self._offered.get(slab) == oldest.stamp:
            return
        self._offered[slab] = oldest.stamp
        heap = self._movable.setdefault(oldest.slot_bytes, [])
        heapq.heappush(heap, (oldest.stamp, slab))
        if len(heap) > 2 * self._alloc.num_slabs + 16:  # mostly stale: start it again
            self._rebuild(oldest.slot_bytes)

    def _oldest_of_class(self, slot_bytes: int) -> tuple[int, int] | None:
        """(stamp, slab) of the class's movable slab with the oldest entry; drops stale items."""
        heap = self._movable[slot_bytes]
        while heap:
            stamp, slab = heap[0]
            oldest = self._movable_now(slab)
            if oldest is not None and oldest.stamp == stamp:
                return stamp, slab
            heapq.heappop(heap)
            if self._offered.get(slab) == stamp:
                del self._offered[slab]
        return None

    def _rebuild(self, slot_bytes: int) -> None:
        for slab in [s for s in self._offered if self._alloc.slab_slot_bytes(s) == slot_bytes]:
            del self._offered[slab]
        heap = []
        for slab in self._slab_lru:
            oldest = self._movable_now(slab)
            if oldest is not None and oldest.slot_bytes == slot_bytes:
                heap.append((oldest.stamp, slab))
                self._offered[slab] = oldest.stamp
        heapq.heapify(heap)
        self._movable[slot_bytes] = heap
