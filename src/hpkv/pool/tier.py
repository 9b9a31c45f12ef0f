"""The DRAM tier's index: which entry lives in which pool slot, in which state, for how long.

Entry life: `reserve` -> (writer copies into the slot) -> `commit` (visible, evictable) or
`abort` (slot freed). Readers and the write-through `pin` an entry; a pinned or uncommitted entry
is never evicted and its slot never reused. Eviction is LRU among committed, unpinned entries:
within the size class that needs a slot, or, when another class holds the least recently used
entries, by draining that class's slab and giving the slab over (memcached-style slab moves).

Primitives: `add_namespace`, `get`, `reserve`, `commit`, `abort`, `pin`, `unpin`, `touch`, `drop`.
Owns no memory: offsets refer to a `PoolRegion` someone else maps. Not thread-safe: the store
serialises calls.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import PoolError
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
    def __init__(self, pool_bytes: int, slab_bytes: int | None = None) -> None:
        self.alloc = SlotAllocator(pool_bytes, slab_bytes)
        self.counters = DramCounters()
        self._entry_bytes: dict[str, int] = {}
        self._index: dict[str, dict[bytes, DramEntry]] = {}
        self._by_offset: dict[int, DramEntry] = {}
        self._used_bytes = 0  # slot bytes of the entries in _by_offset (stats are asked for often)
        self._lru: dict[int, OrderedDict[DramEntry, None]] = {}
        self._clock = itertools.count(1)

    def add_namespace(self, ns: str, entry_bytes: int) -> None:
        if not self.alloc.fits(entry_bytes):
            raise PoolError(
                f"an entry of {entry_bytes} bytes does not fit the pool's slabs of {self.alloc.slab_bytes} "
                f"bytes (1/32 of the pool); raise HPKV_KV_MEM_POOL_SIZE to at least {entry_bytes * 32} bytes")
        self._entry_bytes[ns] = entry_bytes
        self._index.setdefault(ns, {})

    def entry_bytes(self, ns: str) -> int:
        return self._entry_bytes[ns]

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
            offset = self._make_room(slot_bytes)
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

    def drop(self, ns: str | None = None) -> int:
        """Remove every entry (of one namespace): free ones go now, pinned or reserved ones are
        freed when their holder lets go. Returns the number removed."""
        num = 0
        for name in [ns] if ns is not None else list(self._index):
            for entry in list(self._index.get(name, {}).values()):
                self._remove(entry)
                num += 1
        return num

    def stats(self) -> dict[str, int]:
        used = self._used_bytes
        return {
            "capacity_bytes": self.alloc.num_slabs * self.alloc.slab_bytes,
            "used_bytes": used,
            "num_entries": sum(len(i) for i in self._index.values()),
            "free_slabs": self.alloc.num_free_slabs,
            "evictions": self.counters.evictions,
            "slab_moves": self.counters.slab_moves,
            "reserve_failures": self.counters.reserve_failures,
        }

    def _to_lru(self, entry: DramEntry) -> None:
        entry.stamp = next(self._clock)
        lru = self._lru.setdefault(entry.slot_bytes, OrderedDict())
        lru[entry] = None
        lru.move_to_end(entry)  # keeps each LRU in stamp order, which `_make_room` relies on

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

    def _make_room(self, slot_bytes: int) -> int | None:
        own = self._lru.get(slot_bytes)
        own_oldest = next(iter(own)) if own else None
        # Walk the other classes' entries oldest first, not just their heads: the slab of a head
        # may hold a pinned entry while a later slab of that class is free to move.
        tried: set[int] = set()
        for other in self._others_oldest_first(exclude=slot_bytes):
            if own_oldest is not None and own_oldest.stamp < other.stamp:
                break
            slab_index = self.alloc.slab_of(other.offset)
            if slab_index in tried:
                continue
            tried.add(slab_index)
            if self._drain_slab(slab_index):  # mutates the LRUs: leave the walk at once
                self.counters.slab_moves += 1
                return self.alloc.alloc(slot_bytes)
        if own_oldest is None:
            return None
        self._evict(own_oldest)
        return self.alloc.alloc(slot_bytes)

    def _others_oldest_first(self, exclude: int) -> Iterator[DramEntry]:
        # Each LRU is in stamp order (an entry gets a new stamp whenever it moves to the end).
        lrus = [lru for size, lru in self._lru.items() if size != exclude and lru]
        return heapq.merge(*lrus, key=lambda e: e.stamp)

    def _drain_slab(self, slab_index: int) -> bool:
        entries = [self._by_offset[o] for o in self.alloc.used_in_slab(slab_index)]
        if not all(e.evictable for e in entries):
            return False
        for entry in entries:
            self._evict(entry)
        return True

    def _evict(self, entry: DramEntry) -> None:
        del self._index[entry.ns][entry.key]
        self._free(entry)
        self.counters.evictions += 1
