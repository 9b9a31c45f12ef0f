"""Stories about the slot allocator: page-aligned slots, size classes carved from slabs, and slabs
that go back to the free list when empty so that mixed entry sizes never fragment the pool."""

from __future__ import annotations

import pytest

from hpkv.pool.slots import SLOT_ALIGN, SlotAllocator, default_slab_bytes

SLAB = 64 << 10  # 16 pages


def fill(alloc: SlotAllocator, slot_bytes: int) -> list[int]:
    offsets = []
    while (offset := alloc.alloc(slot_bytes)) is not None:
        offsets.append(offset)
    return offsets


def test_entry_sizes_round_up_to_whole_pages():
    alloc = SlotAllocator(4 * SLAB, SLAB)

    assert alloc.slot_bytes_for(1) == 4096
    assert alloc.slot_bytes_for(4096) == 4096
    assert alloc.slot_bytes_for(4097) == 8192
    assert alloc.slot_bytes_for(10_000) == 12288


def test_every_slot_of_every_class_starts_on_a_page():
    alloc = SlotAllocator(8 * SLAB, SLAB)
    offsets = []
    for entry_bytes in (1, 5000, 12288, 20_000):
        slot_bytes = alloc.slot_bytes_for(entry_bytes)
        offsets += [alloc.alloc(slot_bytes) for _ in range(3)]

    assert all(offset % SLOT_ALIGN == 0 for offset in offsets)


def test_the_default_slab_is_a_32nd_of_the_pool_page_aligned_and_bounded():
    assert default_slab_bytes(1 << 30) == 32 << 20
    assert default_slab_bytes(4 << 20) == 1 << 20  # never under 1 MiB
    assert default_slab_bytes(64 << 30) == 256 << 20  # never over 256 MiB
    assert default_slab_bytes((1 << 30) + 12345) % SLOT_ALIGN == 0


def test_a_slab_that_is_not_page_aligned_is_refused():
    with pytest.raises(ValueError, match="4096"):
        SlotAllocator(1 << 20, 100_000)


def test_a_slab_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="larger than the pool"):
        SlotAllocator(SLAB, 2 * SLAB)


def test_slots_do_not_overlap_and_stay_inside_the_pool():
    alloc = SlotAllocator(4 * SLAB, SLAB)
    slot_bytes = alloc.slot_bytes_for(12288)

    offsets = fill(alloc, slot_bytes)

    assert len(offsets) == 4 * (SLAB // slot_bytes)  # 5 per slab, the last 4 KiB of each unused
    spans = sorted((o, o + slot_bytes) for o in offsets)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= 4 * SLAB
    # a slot never straddles two slabs
    assert all(o // SLAB == (o + slot_bytes - 1) // SLAB for o in offsets)


def test_a_full_pool_says_none_and_a_freed_slot_is_handed_out_again():
    alloc = SlotAllocator(2 * SLAB, SLAB)
    offsets = fill(alloc, 4096)
    assert len(offsets) == 32

    alloc.free(offsets[7])

    assert alloc.alloc(4096) == offsets[7]
    assert alloc.alloc(4096) is None


def test_a_slab_emptied_by_one_size_class_is_reused_by_another():
    alloc = SlotAllocator(2 * SLAB, SLAB)
    small = fill(alloc, 4096)  # both slabs now hold 4 KiB slots
    assert alloc.alloc(16384) is None

    for offset in small:
        if alloc.slab_of(offset) == 1:
            alloc.free(offset)

    assert alloc.num_free_slabs == 1
    assert alloc.slab_slot_bytes(1) is None
    big = alloc.alloc(16384)
    assert alloc.slab_of(big) == 1
    assert alloc.slab_slot_bytes(1) == 16384


def test_mixed_sizes_from_two_namespaces_do_not_fragment_the_pool():
    # Two namespaces take turns until the pool is full; then one of them goes away entirely. Every
    # slab it held must come back whole, so the other namespace can fill the pool to the last slot.
    alloc = SlotAllocator(8 * SLAB, SLAB)
    small_bytes, big_bytes = alloc.slot_bytes_for(4096), alloc.slot_bytes_for(20_000)
    small, big = [], []
    while True:
        got_small, got_big = alloc.alloc(small_bytes), alloc.alloc(big_bytes)
        small += [got_small] if got_small is not None else []
        big += [got_big] if got_big is not None else []
        if got_small is None and got_big is None:
            break
    assert small and big
    assert alloc.num_free_slabs == 0

    for offset in big:
        alloc.free(offset)

    assert alloc.num_free_slabs == len({alloc.slab_of(o) for o in big})
    more_small = fill(alloc, small_bytes)
    assert len(small) + len(more_small) == 8 * SLAB // small_bytes


def test_used_in_slab_lists_exactly_the_slots_in_use():
    alloc = SlotAllocator(SLAB, SLAB)
    offsets = fill(alloc, 8192)
    freed = {offsets[1], offsets[4]}
    for offset in freed:
        alloc.free(offset)

    assert alloc.used_in_slab(0) == [o for o in offsets if o not in freed]
