"""Slot allocator for the pool: size classes carved from fixed-size slabs.

The pool is cut into slabs of `slab_bytes`. A slab belongs to one size class at a time and is cut
into slots of that class's size; an empty slab goes back to the free list at once, so pools shared
by namespaces with different entry sizes do not fragment (the memcached scheme).

Primitives: `slot_bytes_for`, `alloc`, `free`, `release_slab`, `slab_of`, `num_used_in_slab`,
`used_in_slab`.
A slab is handed out only once the pool's pages behind it are ready (`ready`: the bytes from the
start of the pool whose pages are reserved, growing while the owner reserves them in the
background); free slabs go lowest first, so those are the ones already backed.
Mechanism only: which entry to evict when `alloc` fails is the caller's decision.
Not thread-safe: the owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable

SLOT_ALIGN = 4096  # page-aligned slots: device DMA and O_DIRECT want aligned buffers
MIN_SLAB_BYTES = 1 << 20
MAX_SLAB_BYTES = 256 << 20
SLABS_PER_POOL = 32


def default_slab_bytes(pool_bytes: int) -> int:
    slab = pool_bytes // SLABS_PER_POOL
    slab = max(MIN_SLAB_BYTES, min(MAX_SLAB_BYTES, slab))
    return slab - slab % SLOT_ALIGN


class _Slab:
    __slots__ = ("index", "slot_bytes", "free", "num_used")

    def __init__(self, index: int, slot_bytes: int, slab_bytes: int) -> None:
        self.index = index
        self.slot_bytes = slot_bytes
        base = index * slab_bytes
        # Reversed so that slots are handed out in address order.
        self.free = [base + i * slot_bytes for i in range(slab_bytes // slot_bytes)][::-1]
        self.num_used = 0


class SlotAllocator:
    def __init__(self, pool_bytes: int, slab_bytes: int | None = None, ready: Callable[[], int] | None = None) -> None:
        self.slab_bytes = slab_bytes or default_slab_bytes(pool_bytes)
        if self.slab_bytes % SLOT_ALIGN:
            # Slot offsets are slab starts plus multiples of the slot size: an odd slab misaligns them all.
            raise ValueError(f"slab of {self.slab_bytes} bytes is not a multiple of {SLOT_ALIGN}")
        if self.slab_bytes > pool_bytes:
            raise ValueError(f"slab of {self.slab_bytes} bytes is larger than the pool ({pool_bytes})")
        self.num_slabs = pool_bytes // self.slab_bytes
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self._slabs: dict[int, _Slab] = {}
        self._partial: dict[int, dict[int, _Slab]] = {}  # slot_bytes -> slabs with a free slot
        self._ready = ready  # None: every page is there
        self._all_ready = ready is None

    def slot_bytes_for(self, entry_bytes: int) -> int:
        return -(-entry_bytes // SLOT_ALIGN) * SLOT_ALIGN

    def fits(self, entry_bytes: int) -> bool:
        return self.slot_bytes_for(entry_bytes) <= self.slab_bytes

    def alloc(self, slot_bytes: int) -> int | None:
        """A free slot of `slot_bytes` (an offset into the pool), or None when the pool is full."""
        partial = self._partial.setdefault(slot_bytes, {})
        if partial:
            slab = next(iter(partial.values()))
        elif self._free_slabs and self._backed(self._free_slabs[-1]):
            index = self._free_slabs.pop()
            slab = self._slabs[index] = _Slab(index, slot_bytes, self.slab_bytes)
            partial[index] = slab
        else:
            return None
        offset = slab.free.pop()
        slab.num_used += 1
        if not slab.free:
            del partial[slab.index]
        return offset

    def _backed(self, index: int) -> bool:
        """Whether slab `index` has pages behind it. The free slabs never handed out are the
        list's head, highest first, so the last free slab is the lowest of them or one handed
        out before: if it is not backed, no free slab is."""
        if self._all_ready:
            return True
        assert self._ready is not None
        ready = self._ready()
        self._all_ready = ready >= self.num_slabs * self.slab_bytes
        return (index + 1) * self.slab_bytes <= ready

    def free(self, offset: int) -> None:
        slab = self._slabs[offset // self.slab_bytes]
        slab.free.append(offset)
        slab.num_used -= 1
        partial = self._partial[slab.slot_bytes]
        if slab.num_used == 0:
            partial.pop(slab.index, None)
            del self._slabs[slab.index]
            self._free_slabs.append(slab.index)
        else:
            partial[slab.index] = slab

    def release_slab(self, slab_index: int) -> None:
        """Give a slab back whole: the caller's entries in every used slot of it are gone (what
        freeing each slot would do, at once)."""
        slab = self._slabs.pop(slab_index)
        self._partial[slab.slot_bytes].pop(slab_index, None)
        self._free_slabs.append(slab_index)

    def slab_of(self, offset: int) -> int:
        return offset // self.slab_bytes

    def slab_slot_bytes(self, slab_index: int) -> int | None:
        slab = self._slabs.get(slab_index)
        return slab.slot_bytes if slab else None

    def num_used_in_slab(self, slab_index: int) -> int:
        slab = self._slabs.get(slab_index)
        return slab.num_used if slab else 0

    def used_in_slab(self, slab_index: int) -> list[int]:
        """Offsets of the used slots of a slab (for draining it)."""
        slab = self._slabs[slab_index]
        base = slab_index * self.slab_bytes
        free = set(slab.free)
        return [o for o in range(base, base + self.slab_bytes - slab.slot_bytes + 1, slab.slot_bytes) if o not in free]

    @property
    def num_free_slabs(self) -> int:
        return len(self._free_slabs)
