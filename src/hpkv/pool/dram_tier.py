"""The DRAM tier's index: which entry lives in which pool slot, in which state, for how long.

Entry life: `reserve` -> (writer copies into the slot) -> `commit` (visible, evictable) or
`abort` (slot freed). Readers and the write-through `pin` an entry; a pinned or uncommitted entry
is never evicted and its slot never reused. Eviction is LRU among committed, unpinned entries:
within the size class that needs a slot, or, when another class holds the least recently used
entries, by draining that class's slab and giving the slab over (memcached-style slab moves).
Which entry or slab goes is the room policy's (`pool/room.py`, given to the tier), decided from
the evictable entries (`lru`, `pool/lru.py`: each class's LRU and the books of slabs that could
move, kept from the time a second size class appears: a pool of one size class never moves a slab).

Owns: the index (namespace -> key -> `DramEntry`, `pool/entry.py`), the entries by slot, the
allocator, the evictable entries, the counters.
Primitives: `add_namespace`/`remove_namespace`, `get`, `reserve`, `commit`, `abort`,
`pin`, `unpin`, `touch`, `drop`; `changes`, told each committed entry that enters or leaves the
index (the tier journal's hook, None while nobody journals);
for room policies (`room.Evictions`): `lru`, `alloc`, `slab_entries`, `move_slab`, `evict_for`.
Owns no memory: offsets refer to a `PoolRegion` someone else maps. Not thread-safe: the store
serialises calls. The store's parts call the tier itself, and each call the tier passes to its
evictable entries does work there (a class's LRU, the slab books): no layer below the store only
passes a call on, but `lru.oldest_movable` (whether slab books are kept at all is `lru`'s).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import PoolError
from ..stats import DramStats
from .entry import DramEntry
from .lru import EvictableEntries
from .room import OldestFirst, RoomPolicy
from .slots import SlotAllocator

_NO_ENTRIES: dict = {}  # never written to


@dataclass
class DramCounters:
    evictions: int = 0
    slab_moves: int = 0
    reserve_failures: int = 0


class DramTier:
    def __init__(
        self,
        pool_bytes: int,
        slab_bytes: int | None = None,
        room: RoomPolicy | None = None,
        ready: Callable[[], int] | None = None,
    ) -> None:
        """`ready`: the bytes from the pool's start with pages behind them (`PoolRegion.ready_bytes`);
        None: all."""
        self.alloc = SlotAllocator(pool_bytes, slab_bytes, ready)
        self.room = room if room is not None else OldestFirst()
        self.counters = DramCounters()
        self._entry_bytes: dict[str, int] = {}
        self._index: dict[str, dict[bytes, DramEntry]] = {}
        self._by_offset: dict[int, DramEntry] = {}
        self._live: dict[str, int] = {}  # entries in _by_offset, by namespace (absent: none)
        self._used_bytes = 0  # slot bytes of the entries in _by_offset (stats are asked for often)
        self.lru = EvictableEntries()  # what may be evicted, for the room policy
        # Told (ns, key, stored) when a committed entry enters or leaves the index: the tier
        # journal's recorder while some namespace is journaled, else None (nothing runs).
        self.changes: Callable[[str, bytes, bool], None] | None = None

    def add_namespace(self, ns: str, entry_bytes: int) -> None:
        if not self.alloc.fits(entry_bytes):
            raise PoolError(
                f"an entry of {entry_bytes} bytes does not fit the pool's slabs of {self.alloc.slab_bytes} "
                f"bytes (1/32 of the pool); raise HPKV_KV_MEM_POOL_SIZE to at least {entry_bytes * 32} bytes"
            )
        self._entry_bytes[ns] = entry_bytes
        self._index.setdefault(ns, {})
        if len({self.alloc.slot_bytes_for(b) for b in self._entry_bytes.values()}) > 1:
            self.lru.track_slabs(self.alloc)

    def remove_namespace(self, ns: str) -> bool:
        """Forget `ns` if it holds no entry, not even one out of the index that a holder still
        pins; whether it is gone."""
        if self._index.get(ns) or self._live.get(ns):
            return False
        self._entry_bytes.pop(ns, None)
        self._index.pop(ns, None)
        return True

    def entry_bytes(self, ns: str) -> int:
        return self._entry_bytes[ns]

    def slot_bytes(self, ns: str) -> int:
        return self.alloc.slot_bytes_for(self._entry_bytes[ns])

    def index_of(self, ns: str) -> dict[bytes, DramEntry]:
        """The live key -> entry map of a namespace (read-only for callers; fast lookups); empty
        for one that is gone (`remove_namespace`)."""
        return self._index.get(ns, _NO_ENTRIES)

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
        self._live[ns] = self._live.get(ns, 0) + 1
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
            self.lru.add(entry)
        if self.changes is not None:
            self.changes(entry.ns, entry.key, True)
        return True

    def abort(self, entry: DramEntry) -> None:
        entry.reserved = False
        if not entry.dead:
            del self._index[entry.ns][entry.key]
            entry.dead = True
        self._free_if_unheld(entry)

    def pin(self, entry: DramEntry) -> None:
        if entry.evictable:
            self.lru.unlist(entry)
        entry.refs += 1

    def unpin(self, entry: DramEntry) -> None:
        entry.refs -= 1
        if entry.refs:
            return
        if entry.dead:
            self._free_if_unheld(entry)
        elif entry.ready:
            self.lru.add(entry)

    def touch(self, entry: DramEntry) -> None:
        if entry.evictable:
            self.lru.touch(entry)

    def drop(self, ns: str | None = None) -> int:
        """Remove every entry (of one namespace): free ones go now, pinned or reserved ones are
        freed when their holder lets go. Returns the number removed."""
        num = 0
        for name in [ns] if ns is not None else list(self._index):
            index = self._index.get(name, {})
            for entry in list(index.values()):
                del index[entry.key]
                if entry.ready and self.changes is not None:
                    self.changes(entry.ns, entry.key, False)
                if entry.evictable:
                    self._free(entry)
                else:
                    entry.dead = True  # freed when its holder lets go
                num += 1
        return num

    @property
    def num_entries(self) -> int:
        return sum(len(i) for i in self._index.values())

    def stats(self, backing: dict | None = None) -> DramStats:
        """The tier's snapshot; `backing`, the region's pages (`PoolRegion.backing_stats`), is its
        mapper's to say."""
        return DramStats(
            capacity_bytes=self.alloc.num_slabs * self.alloc.slab_bytes,
            used_bytes=self._used_bytes,
            num_entries=self.num_entries,
            free_slabs=self.alloc.num_free_slabs,
            evictions=self.counters.evictions,
            slab_moves=self.counters.slab_moves,
            reserve_failures=self.counters.reserve_failures,
            **(backing or {"locked_in_memory": False, "ready_bytes": self.alloc.num_slabs * self.alloc.slab_bytes}),
        )

    def _free_if_unheld(self, entry: DramEntry) -> None:
        if entry.refs == 0 and not entry.reserved and self._by_offset.get(entry.offset) is entry:
            self._free(entry)

    def _free(self, entry: DramEntry) -> None:
        entry.dead = True
        del self._by_offset[entry.offset]
        self._live[entry.ns] -= 1
        if not self._live[entry.ns]:
            del self._live[entry.ns]
        self._used_bytes -= entry.slot_bytes
        self.alloc.free(entry.offset)
        self.lru.freed(entry)

    # -- for room policies (`pool/room.py`) ---------------------------------------------------

    def slab_entries(self, slab: int) -> list[DramEntry]:
        return [self._by_offset[o] for o in self.alloc.used_in_slab(slab)]

    def move_slab(self, slab: int, slot_bytes: int) -> int | None:
        """Evict every entry of a slab whose entries are all evictable (in bulk: a slab of small
        entries holds thousands, and this runs under the store's lock); a slot of the freed slab,
        which moves to the class of `slot_bytes`."""
        entries = self.lru.take_slab(slab)
        their_bytes = entries[0].slot_bytes  # a slab that moves holds entries, all of one class
        by_offset, index, live = self._by_offset, self._index, self._live
        changes = self.changes
        for entry in entries:
            entry.dead = True
            del index[entry.ns][entry.key]
            if changes is not None:
                changes(entry.ns, entry.key, False)
            del by_offset[entry.offset]
            live[entry.ns] -= 1
            if not live[entry.ns]:
                del live[entry.ns]
        self._used_bytes -= len(entries) * their_bytes
        self.counters.evictions += len(entries)
        self.alloc.release_slab(slab)
        self.counters.slab_moves += 1
        return self.alloc.alloc(slot_bytes)

    def evict_for(self, entry: DramEntry, slot_bytes: int) -> int | None:
        """Evict an evictable entry of the class; a slot of the class."""
        del self._index[entry.ns][entry.key]
        if self.changes is not None:
            self.changes(entry.ns, entry.key, False)
        self._free(entry)
        self.counters.evictions += 1
        return self.alloc.alloc(slot_bytes)
