"""The DRAM tier's index: which entry lives in which pool slot, in which state, for how long.

Entry life: `reserve` -> (writer copies into the slot) -> `commit` (visible, evictable) or
`abort` (slot freed). Readers and the write-through `pin` an entry; a pinned or uncommitted entry
is never evicted and its slot never reused. Eviction is LRU among committed, unpinned entries:
within the size class that needs a slot, or, when another class holds the least recently used
entries, by draining that class's slab and giving the slab over (memcached-style slab moves).
Which entry or slab goes is the room policy's (`pool/room.py`, given to the tier); the tier keeps
the books it decides from: each slab's evictable entries in LRU order, and each class a heap of
its slabs that could move, keyed by their oldest entry (stale items are skipped when met), kept
from the time a second size class appears (a pool of one size class never moves a slab).

Primitives: `add_namespace`, `get`, `reserve`, `commit`, `abort`, `pin`, `unpin`, `touch`, `drop`;
for room policies: `oldest`, `oldest_movable_slab`, `evictable_by_class`, `slab_entries`,
`move_slab`, `evict_for`. Owns no memory: offsets refer to a `PoolRegion` someone else maps.
Not thread-safe: the store serialises calls.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import PoolError
from .room import OldestFirst, RoomPolicy
from .slots import SlotAllocator


class DramEntry:
    __slots__ = ("ns", "key", "offset", "slot_bytes", "reserved", "ready", "refs", "dead", "stamp")

    def __init__(self, ns: str, key: bytes, offset: int, slot_bytes: int) -> None:
        self.ns = ns
        self.key = key
        self.offset = offset
        self.slot_bytes = slot_bytes
        self.reserved = True  # a writer owns the slot until commit or abort
        self.ready = False
        self.refs = 0
        self.dead = False  # out of the index; the slot is freed once nobody holds it
        self.stamp = 0

    @property
    def evictable(self) -> bool:
        return self.ready and self.refs == 0 and not self.dead


@dataclass
class DramCounters:
    evictions: int = 0
    slab_moves: int = 0
    reserve_failures: int = 0


class DramTier:
    def __init__(self, pool_bytes: int, slab_bytes: int | None = None, room: RoomPolicy | None = None) -> None:
        self.alloc = SlotAllocator(pool_bytes, slab_bytes)
        self.room = room if room is not None else OldestFirst()
        self.counters = DramCounters()
        self._entry_bytes: dict[str, int] = {}
        self._index: dict[str, dict[bytes, DramEntry]] = {}
        self._by_offset: dict[int, DramEntry] = {}
        self._used_bytes = 0  # slot bytes of the entries in _by_offset (stats are asked for often)
        self._lru: dict[int, OrderedDict[DramEntry, None]] = {}  # slot_bytes -> evictable entries, oldest first
        self._slab_lru: dict[int, OrderedDict[DramEntry, None]] = {}  # slab -> the same, per slab
        # slot_bytes -> heap of (stamp of the oldest entry, slab) of slabs whose entries were all
        # evictable when pushed; an item is stale once its slab's oldest entry has another stamp
        self._movable: dict[int, list[tuple[int, int]]] = {}
        self._offered: dict[int, int] = {}  # slab -> the stamp of its item in the heap
        self._by_slab = False  # whether the three above are kept: from the second size class on
        self._clock = itertools.count(1)

    def add_namespace(self, ns: str, entry_bytes: int) -> None:
        if not self.alloc.fits(entry_bytes):
            raise PoolError(
                f"an entry of {entry_bytes} bytes does not fit the pool's slabs of {self.alloc.slab_bytes} "
                f"bytes (1/32 of the pool); raise HPKV_KV_MEM_POOL_SIZE to at least {entry_bytes * 32} bytes")
        self._entry_bytes[ns] = entry_bytes
        self._index.setdefault(ns, {})
        if not self._by_slab and len({self.alloc.slot_bytes_for(b) for b in self._entry_bytes.values()}) > 1:
            self._start_by_slab()

    def entry_bytes(self, ns: str) -> int:
        return self._entry_bytes[ns]

    def slot_bytes(self, ns: str) -> int:
        return self.alloc.slot_bytes_for(self._entry_bytes[ns])

    def index_of(self, ns: str) -> dict[bytes, DramEntry]:
        """The live key -> entry map of a namespace (read-only for callers; fast lookups)."""
        return self._index[ns]

    def get(self, ns: str, key: bytes) -> DramEntry | None:
        return self._index[ns].get(key)

    def reserve(self, ns: str, key: bytes) -> DramEntry | None:
        """A new uncommitted entry for `key`, evicting if needed; None if the key is present or
        every slot is pinned or reserved."""
        index = self._index[ns]
        if key in index:
            return None
        slot_bytes = self.alloc.slot_bytes_for(self._entry_bytes[ns])
        offset = self.alloc.alloc(slot_bytes)
        if offset is None:
            offset = self.room.make_room(self, slot_bytes)
            if offset is None:
                self.counters.reserve_failures += 1
                return None
        entry = DramEntry(ns, key, offset, slot_bytes)
        index[key] = entry
        self._by_offset[offset] = entry
        self._used_bytes += slot_bytes
        return entry

    def commit(self, entry: DramEntry) -> bool:
        """Publish a reserved entry. False (and the slot freed) if it was dropped meanwhile."""
        entry.reserved = False
        if entry.dead:
            self._free_if_unheld(entry)
            return False
        entry.ready = True
        if entry.refs == 0:
            self._to_lru(entry)
        return True

    def abort(self, entry: DramEntry) -> None:
        entry.reserved = False
        if not entry.dead:
            del self._index[entry.ns][entry.key]
            entry.dead = True
        self._free_if_unheld(entry)

    def pin(self, entry: DramEntry) -> None:
        if entry.evictable:
            self._lru[entry.slot_bytes].pop(entry, None)
            if self._by_slab:
                self._slab_lru[self.alloc.slab_of(entry.offset)].pop(entry, None)
        entry.refs += 1

    def unpin(self, entry: DramEntry) -> None:
        entry.refs -= 1
        if entry.refs:
            return
        if entry.dead:
            self._free_if_unheld(entry)
        elif entry.ready:
            self._to_lru(entry)

    def touch(self, entry: DramEntry) -> None:
        if entry.evictable:
            self._lru[entry.slot_bytes].move_to_end(entry)
            entry.stamp = next(self._clock)
            if not self._by_slab:
                return
            slab = self.alloc.slab_of(entry.offset)
            slab_lru = self._slab_lru[slab]
            was_oldest = next(iter(slab_lru)) is entry
            slab_lru.move_to_end(entry)
            if was_oldest:
                self._offer(slab)

    def drop(self, ns: str | None = None) -> int:
        """Remove every entry (of one namespace): free ones go now, pinned or reserved ones are
        freed when their holder lets go. Returns the number removed."""
        num = 0
        for name in [ns] if ns is not None else list(self._index):
            for entry in list(self._index.get(name, {}).values()):
                self._remove(entry)
                num += 1
        return num

    @property
    def num_entries(self) -> int:
        return sum(len(i) for i in self._index.values())

    def stats(self) -> dict[str, int]:
        used = self._used_bytes
        return {
            "capacity_bytes": self.alloc.num_slabs * self.alloc.slab_bytes,
            "used_bytes": used,
            "num_entries": self.num_entries,
            "free_slabs": self.alloc.num_free_slabs,
            "evictions": self.counters.evictions,
            "slab_moves": self.counters.slab_moves,
            "reserve_failures": self.counters.reserve_failures,
        }

    def _to_lru(self, entry: DramEntry) -> None:
        entry.stamp = next(self._clock)
        # Each LRU stays in stamp order, which the room policies rely on.
        lru = self._lru.setdefault(entry.slot_bytes, OrderedDict())
        lru[entry] = None
        lru.move_to_end(entry)
        if self._by_slab:
            slab = self.alloc.slab_of(entry.offset)
            slab_lru = self._slab_lru.setdefault(slab, OrderedDict())
            slab_lru[entry] = None
            slab_lru.move_to_end(entry)
            self._offer(slab)

    def _remove(self, entry: DramEntry) -> None:
        del self._index[entry.ns][entry.key]
        if entry.evictable:
            self._free(entry)
        else:
            entry.dead = True

    def _free_if_unheld(self, entry: DramEntry) -> None:
        if entry.refs == 0 and not entry.reserved and self._by_offset.get(entry.offset) is entry:
            self._free(entry)

    def _free(self, entry: DramEntry) -> None:
        entry.dead = True
        self._lru.get(entry.slot_bytes, {}).pop(entry, None)
        del self._by_offset[entry.offset]
        self._used_bytes -= entry.slot_bytes
        self.alloc.free(entry.offset)
        if not self._by_slab:
            return
        slab = self.alloc.slab_of(entry.offset)
        self._slab_lru.get(slab, {}).pop(entry, None)
        if not self.alloc.num_used_in_slab(slab):
            self._slab_lru.pop(slab, None)
            self._offered.pop(slab, None)
        else:
            self._offer(slab)

    # -- for room policies (`pool/room.py`) ---------------------------------------------------

    def oldest(self, slot_bytes: int) -> DramEntry | None:
        """The class's least recently used evictable entry."""
        own = self._lru.get(slot_bytes)
        return next(iter(own)) if own else None

    def oldest_movable_slab(self, slot_bytes: int) -> tuple[int, int] | None:
        """(stamp of its oldest entry, slab) of the slab of another class whose entries are all
        evictable and whose oldest entry is the oldest of such slabs; O(log slabs)."""
        best: tuple[int, int] | None = None
        for other in self._movable:
            if other != slot_bytes:
                top = self._oldest_movable(other)
                if top is not None and (best is None or top < best):
                    best = top
        return best

    def evictable_by_class(self) -> dict[int, OrderedDict[DramEntry, None]]:
        """slot_bytes -> that class's evictable entries, oldest first (read-only for callers)."""
        return self._lru

    def slab_entries(self, slab: int) -> list[DramEntry]:
        return [self._by_offset[o] for o in self.alloc.used_in_slab(slab)]

    def move_slab(self, slab: int, slot_bytes: int) -> int | None:
        """Evict every entry of a slab whose entries are all evictable; a slot of the freed slab."""
        self._drain_slab(slab)
        self.counters.slab_moves += 1
        return self.alloc.alloc(slot_bytes)

    def evict_for(self, entry: DramEntry, slot_bytes: int) -> int | None:
        """Evict an evictable entry of the class; a slot of the class."""
        self._evict(entry)
        return self.alloc.alloc(slot_bytes)

    def _start_by_slab(self) -> None:
        """Sort the evictable entries by slab (each class's LRU is in stamp order: so is each
        slab's, a slab serving one class) and offer every slab."""
        for lru in self._lru.values():
            for entry in lru:
                self._slab_lru.setdefault(self.alloc.slab_of(entry.offset), OrderedDict())[entry] = None
        self._by_slab = True
        for slab in list(self._slab_lru):
            self._offer(slab)

    def _movable_now(self, slab: int) -> DramEntry | None:
        """The oldest entry of a slab whose entries are all evictable (None if one is not)."""
        slab_lru = self._slab_lru.get(slab)
        if not slab_lru or len(slab_lru) != self.alloc.num_used_in_slab(slab):
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
        if len(heap) > 2 * self.alloc.num_slabs + 16:  # mostly stale: start it again
            self._rebuild_movable(oldest.slot_bytes)

    def _oldest_movable(self, slot_bytes: int) -> tuple[int, int] | None:
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

    def _rebuild_movable(self, slot_bytes: int) -> None:
        for slab in [s for s in self._offered if self.alloc.slab_slot_bytes(s) == slot_bytes]:
            del self._offered[slab]
        heap = []
        for slab in self._slab_lru:
            oldest = self._movable_now(slab)
            if oldest is not None and oldest.slot_bytes == slot_bytes:
                heap.append((oldest.stamp, slab))
                self._offered[slab] = oldest.stamp
        heapq.heapify(heap)
        self._movable[slot_bytes] = heap

    def _drain_slab(self, slab: int) -> None:
        """Evict every entry of a slab whose entries are all evictable: the slab goes free (in
        bulk: a slab of small entries holds thousands, and this runs under the store's lock)."""
        entries = self._slab_lru.pop(slab)
        self._offered.pop(slab, None)
        lru, by_offset, index = self._lru[self.alloc.slab_slot_bytes(slab)], self._by_offset, self._index
        for entry in entries:
            entry.dead = True
            del index[entry.ns][entry.key]
            del lru[entry]
            del by_offset[entry.offset]
        self._used_bytes -= len(entries) * self.alloc.slab_slot_bytes(slab)
        self.counters.evictions += len(entries)
        self.alloc.release_slab(slab)

    def _evict(self, entry: DramEntry) -> None:
        del self._index[entry.ns][entry.key]
        self._free(entry)
        self.counters.evictions += 1
