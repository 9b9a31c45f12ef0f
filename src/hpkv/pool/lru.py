"""The DRAM tier's evictable entries: per size class, an LRU in stamp order, and the books of
slabs that could move (`movable.py`), kept from the time a second size class appears.

Also `PrefixOrder`: the order in which entries used together (a commit, a lease's release) reach
the LRU, which the store is given (`store.StorePolicy`).

Primitives, told by the tier: `add`, `unlist`, `freed`, `touch`, `track_slabs`, `take_slab`; asked by
room policies (`room.py`): `by_class`, `oldest_movable`.
Must not know: the index, pins beyond "evictable", or which policy asks.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TypeVar

from .entry import DramEntry
from .movable import MovableSlabs
from .slots import SlotAllocator

T = TypeVar("T")


class PrefixOrder(enum.Enum):
    """How a prefix's entries, used together, reach the LRU (the last to reach it goes last)."""

    LAST_FIRST = "last first"  # the store's: eviction shortens a prefix from its end
    FIRST_FIRST = "first first"  # plain LRU in prefix order: a baseline for benchmarks

    def arrange(self, entries: Sequence[T]) -> Iterable[T]:
        """`entries` (in prefix order) in the order they are to be published or unpinned."""
        return reversed(entries) if self is PrefixOrder.LAST_FIRST else iter(entries)


class EvictableEntries:
    def __init__(self) -> None:
        self._lru: dict[int, OrderedDict[DramEntry, None]] = {}  # slot_bytes -> evictable entries, oldest first
        self._slabs: MovableSlabs | None = None  # kept from the second size class on
        self._clock = itertools.count(1)

    def track_slabs(self, alloc: SlotAllocator) -> None:
        """Keep the books of movable slabs from now on (a second size class appeared)."""
        if self._slabs is None:
            self._slabs = MovableSlabs(alloc, self._lru.values())

    def add(self, entry: DramEntry) -> None:
        """`entry` is evictable now, the most recently used."""
        entry.stamp = next(self._clock)
        # Each LRU stays in stamp order, which the room policies rely on.
        lru = self._lru.setdefault(entry.slot_bytes, OrderedDict())
        lru[entry] = None
        lru.move_to_end(entry)
        if self._slabs is not None:
            self._slabs.added(entry)

    def unlist(self, entry: DramEntry) -> None:
        """`entry`, evictable, is pinned: evictable no more."""
        self._lru[entry.slot_bytes].pop(entry, None)
        if self._slabs is not None:
            self._slabs.removed(entry)

    def freed(self, entry: DramEntry) -> None:
        """`entry`'s slot is free."""
        lru = self._lru.get(entry.slot_bytes)
        if lru is not None:
            lru.pop(entry, None)
        if self._slabs is not None:
            self._slabs.freed(entry)

    def touch(self, entry: DramEntry) -> None:
        """`entry`, evictable, is the most recently used now."""
        self._lru[entry.slot_bytes].move_to_end(entry)
        entry.stamp = next(self._clock)
        if self._slabs is not None:
            self._slabs.touched(entry)

    def take_slab(self, slab: int) -> list[DramEntry]:
        """The entries of a slab that moves (all evictable, of one class), off the slabs' books
        and off their class's LRU: evictable no more (a pass over a slab of thousands, under the
        lock)."""
        assert self._slabs is not None  # a slab moves only between two size classes
        entries = list(self._slabs.drain(slab))
        lru = self._lru[entries[0].slot_bytes]
        for entry in entries:
            del lru[entry]
        return entries

    def by_class(self) -> dict[int, OrderedDict[DramEntry, None]]:
        """slot_bytes -> that class's evictable entries, oldest first (read-only for callers)."""
        return self._lru

    def oldest_movable(self, slot_bytes: int) -> tuple[int, int] | None:
        """(stamp of its oldest entry, slab) of the slab of another class whose entries are all
        evictable and whose oldest entry is the oldest of such slabs; O(log slabs)."""
        return self._slabs.oldest_movable(slot_bytes) if self._slabs is not None else None
