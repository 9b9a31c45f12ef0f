"""Stories about the DRAM tier's index: two-phase writes, pins, LRU eviction, slab moves between
size classes, and drops that wait for their holders."""

from __future__ import annotations

import pytest

from hpkv.errors import PoolError
from hpkv.pool.dram_tier import DramTier

PAGE = 4096
NS_A = "a" * 32
NS_B = "b" * 32


def tier_with_slots(num_slots: int, entry_bytes: int = PAGE) -> DramTier:
    """A tier of one slab holding exactly `num_slots` entries of one namespace (NS_A)."""
    tier = DramTier(num_slots * entry_bytes, num_slots * entry_bytes)
    tier.add_namespace(NS_A, entry_bytes)
    return tier


def put(tier: DramTier, ns: str, key: bytes):
    entry = tier.reserve(ns, key)
    assert entry is not None, f"no slot for {key!r}"
    assert tier.commit(entry)
    return entry


def keys_of(tier: DramTier, ns: str) -> set[bytes]:
    return set(tier.index_of(ns))


def test_capacity_four_insert_five_the_first_is_evicted():
    tier = tier_with_slots(4)
    for key in (b"k1", b"k2", b"k3", b"k4", b"k5"):
        put(tier, NS_A, key)

    assert keys_of(tier, NS_A) == {b"k2", b"k3", b"k4", b"k5"}
    assert tier.stats().evictions == 1


def test_the_newcomer_takes_the_slot_of_the_evicted_entry():
    tier = tier_with_slots(4)
    first = put(tier, NS_A, b"k1")
    for key in (b"k2", b"k3", b"k4"):
        put(tier, NS_A, key)

    newcomer = put(tier, NS_A, b"k5")

    assert newcomer.offset == first.offset
    assert first.dead


def test_touching_the_oldest_makes_the_next_one_go_instead():
    tier = tier_with_slots(4)
    first = put(tier, NS_A, b"k1")
    for key in (b"k2", b"k3", b"k4"):
        put(tier, NS_A, key)

    tier.touch(first)
    put(tier, NS_A, b"k5")

    assert keys_of(tier, NS_A) == {b"k1", b"k3", b"k4", b"k5"}


def test_a_reserved_entry_is_not_ready_for_readers_until_commit():
    tier = tier_with_slots(4)
    entry = tier.reserve(NS_A, b"k1")

    assert tier.get(NS_A, b"k1") is entry
    assert not entry.ready

    tier.commit(entry)

    assert tier.get(NS_A, b"k1").ready


def test_a_key_already_present_is_not_reserved_twice():
    tier = tier_with_slots(4)
    put(tier, NS_A, b"k1")

    assert tier.reserve(NS_A, b"k1") is None
    assert tier.stats().num_entries == 1
    assert tier.stats().reserve_failures == 0


def test_an_uncommitted_entry_is_never_evicted():
    tier = tier_with_slots(4)
    writing = tier.reserve(NS_A, b"k1")  # the oldest, but its writer is still copying
    for key in (b"k2", b"k3", b"k4", b"k5"):
        put(tier, NS_A, key)

    assert keys_of(tier, NS_A) == {b"k1", b"k3", b"k4", b"k5"}
    assert not writing.dead
    assert tier.commit(writing)


def test_a_pinned_oldest_entry_makes_the_next_oldest_go():
    tier = tier_with_slots(4)
    oldest = put(tier, NS_A, b"k1")
    for key in (b"k2", b"k3", b"k4"):
        put(tier, NS_A, key)

    tier.pin(oldest)
    put(tier, NS_A, b"k5")

    assert keys_of(tier, NS_A) == {b"k1", b"k3", b"k4", b"k5"}


def test_an_entry_pinned_before_its_commit_stays_pinned_after_it():
    # A promotion from storage pins its entry while reserved and commits once the bytes are in.
    tier = tier_with_slots(2)
    promoted = tier.reserve(NS_A, b"k1")
    tier.pin(promoted)
    tier.commit(promoted)
    put(tier, NS_A, b"k2")

    put(tier, NS_A, b"k3")

    assert keys_of(tier, NS_A) == {b"k1", b"k3"}
    assert not promoted.dead


def test_an_entry_pinned_twice_stays_until_both_pins_are_released():
    tier = tier_with_slots(1)
    entry = put(tier, NS_A, b"k1")
    tier.pin(entry)
    tier.pin(entry)

    tier.unpin(entry)
    assert tier.reserve(NS_A, b"k2") is None

    tier.unpin(entry)
    assert tier.reserve(NS_A, b"k2") is not None
    assert entry.dead


def test_an_unpinned_entry_counts_as_just_used():
    tier = tier_with_slots(4)
    oldest = put(tier, NS_A, b"k1")
    for key in (b"k2", b"k3", b"k4"):
        put(tier, NS_A, key)

    tier.pin(oldest)  # a reader leases it...
    tier.unpin(oldest)  # ...and lets go: it is now the most recently used
    put(tier, NS_A, b"k5")

    assert b"k1" in keys_of(tier, NS_A)
    assert b"k2" not in keys_of(tier, NS_A)


def test_reserve_says_none_when_every_slot_is_pinned_or_reserved_and_counts_it():
    tier = tier_with_slots(3)
    pinned = [put(tier, NS_A, b"k1"), put(tier, NS_A, b"k2")]
    for entry in pinned:
        tier.pin(entry)
    tier.reserve(NS_A, b"k3")  # uncommitted

    assert tier.reserve(NS_A, b"k4") is None
    assert tier.reserve(NS_A, b"k5") is None
    assert tier.stats().reserve_failures == 2
    assert keys_of(tier, NS_A) == {b"k1", b"k2", b"k3"}


def test_abort_frees_the_slot_and_forgets_the_key():
    tier = tier_with_slots(1)
    entry = tier.reserve(NS_A, b"k1")

    tier.abort(entry)

    assert tier.get(NS_A, b"k1") is None
    other = tier.reserve(NS_A, b"k2")
    assert other is not None and other.offset == entry.offset
    assert tier.stats().evictions == 0


def test_an_entry_dropped_while_pinned_keeps_its_slot_until_unpinned():
    tier = tier_with_slots(1)
    entry = put(tier, NS_A, b"k1")
    tier.pin(entry)

    assert tier.drop(NS_A) == 1
    assert tier.get(NS_A, b"k1") is None
    assert tier.reserve(NS_A, b"k2") is None  # a reader still copies out of the slot
    assert tier.stats().used_bytes == PAGE

    tier.unpin(entry)

    assert tier.stats().used_bytes == 0
    assert tier.reserve(NS_A, b"k2") is not None


def test_an_entry_dropped_while_reserved_fails_its_commit_and_frees_the_slot():
    tier = tier_with_slots(1)
    entry = tier.reserve(NS_A, b"k1")
    tier.drop()

    assert tier.commit(entry) is False

    assert tier.get(NS_A, b"k1") is None
    assert tier.reserve(NS_A, b"k1") is not None


def test_a_dropped_key_can_be_written_again_while_its_old_slot_is_still_read():
    tier = tier_with_slots(2)
    old = put(tier, NS_A, b"k1")
    tier.pin(old)
    tier.drop(NS_A)

    new = put(tier, NS_A, b"k1")
    tier.unpin(old)

    assert tier.get(NS_A, b"k1") is new
    assert new.offset != old.offset
    assert tier.stats().num_entries == 1
    assert tier.stats().used_bytes == PAGE


def test_drop_of_one_namespace_keeps_the_other():
    tier = DramTier(8 * PAGE, 4 * PAGE)
    tier.add_namespace(NS_A, PAGE)
    tier.add_namespace(NS_B, PAGE)
    put(tier, NS_A, b"k1")
    put(tier, NS_B, b"k1")

    assert tier.drop(NS_A) == 1

    assert keys_of(tier, NS_A) == set()
    assert keys_of(tier, NS_B) == {b"k1"}


def test_an_entry_larger_than_a_slab_is_refused_with_the_size_to_use():
    tier = DramTier(32 * PAGE, 4 * PAGE)

    with pytest.raises(PoolError, match="HPKV_KV_MEM_POOL_SIZE"):
        tier.add_namespace(NS_A, 4 * PAGE + 1)


def two_namespace_tier() -> DramTier:
    """Two slabs of 16 KiB: NS_A keeps 4 KiB entries (4 a slab), NS_B 8 KiB entries (2 a slab)."""
    tier = DramTier(8 * PAGE, 4 * PAGE)
    tier.add_namespace(NS_A, PAGE)
    tier.add_namespace(NS_B, 2 * PAGE)
    return tier


def test_two_namespaces_of_different_sizes_share_one_pool():
    tier = two_namespace_tier()
    a = [put(tier, NS_A, b"a%d" % i) for i in range(4)]
    b = [put(tier, NS_B, b"b%d" % i) for i in range(2)]

    assert {tier.alloc.slab_of(e.offset) for e in a} != {tier.alloc.slab_of(e.offset) for e in b}
    assert tier.stats().used_bytes == tier.stats().capacity_bytes
    assert tier.stats().evictions == 0


def test_when_the_own_class_holds_the_oldest_entry_it_is_evicted_in_place():
    tier = two_namespace_tier()
    for i in range(4):
        put(tier, NS_A, b"a%d" % i)
    for i in range(2):
        put(tier, NS_B, b"b%d" % i)

    put(tier, NS_A, b"a4")

    assert keys_of(tier, NS_A) == {b"a1", b"a2", b"a3", b"a4"}
    assert keys_of(tier, NS_B) == {b"b0", b"b1"}
    assert tier.stats().slab_moves == 0


def test_a_slab_moves_from_the_class_whose_entries_are_older():
    tier = two_namespace_tier()
    for i in range(2):
        put(tier, NS_B, b"b%d" % i)  # older
    for i in range(4):
        put(tier, NS_A, b"a%d" % i)

    newcomer = put(tier, NS_A, b"a4")

    assert keys_of(tier, NS_B) == set()
    assert keys_of(tier, NS_A) == {b"a0", b"a1", b"a2", b"a3", b"a4"}
    assert tier.alloc.slab_slot_bytes(tier.alloc.slab_of(newcomer.offset)) == PAGE
    assert tier.stats().slab_moves == 1
    assert tier.stats().evictions == 2


def test_a_slab_with_a_pinned_entry_does_not_move():
    tier = two_namespace_tier()
    b0 = put(tier, NS_B, b"b0")
    put(tier, NS_B, b"b1")
    for i in range(4):
        put(tier, NS_A, b"a%d" % i)
    tier.pin(b0)

    put(tier, NS_A, b"a4")

    assert keys_of(tier, NS_B) == {b"b0", b"b1"}
    assert keys_of(tier, NS_A) == {b"a1", b"a2", b"a3", b"a4"}
    assert tier.stats().slab_moves == 0


def test_a_class_without_a_slab_takes_one_whose_entries_are_all_free():
    # NS_A fills both slabs; its oldest entry shares slab 0 with a pinned one, so slab 0 cannot
    # move. Slab 1 holds only unpinned entries and must be given to NS_B.
    tier = two_namespace_tier()
    a = [put(tier, NS_A, b"a%d" % i) for i in range(8)]
    assert tier.alloc.slab_of(a[0].offset) == tier.alloc.slab_of(a[1].offset)
    tier.pin(a[1])

    newcomer = tier.reserve(NS_B, b"b0")

    assert newcomer is not None
    assert tier.alloc.slab_of(newcomer.offset) == tier.alloc.slab_of(a[7].offset)
    assert keys_of(tier, NS_A) == {b"a0", b"a1", b"a2", b"a3"}
    assert tier.stats().slab_moves == 1


def test_a_class_without_a_slab_fails_when_every_slab_holds_a_pinned_entry():
    tier = two_namespace_tier()
    a = [put(tier, NS_A, b"a%d" % i) for i in range(8)]
    tier.pin(a[0])
    tier.pin(a[7])

    assert tier.reserve(NS_B, b"b0") is None
    assert tier.stats().reserve_failures == 1
    assert len(keys_of(tier, NS_A)) == 8
