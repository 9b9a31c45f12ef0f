"""Stories about finding room in a full pool shared by two entry sizes: the work it takes does not
grow with the number of entries, and the entries it evicts are the ones the walk of every older
entry (the policy as documented in docs/architecture.md) would have evicted."""

from __future__ import annotations

import random

import pytest

from hpkv.pool.dram_tier import DramTier
from hpkv.pool.entry import DramEntry
from hpkv.pool.room import WalkOldest

PAGE = 4096
NS_A = "a" * 32  # one page per entry
NS_B = "b" * 32  # four pages per entry
NS_C = "c" * 32  # two pages per entry
SLAB = 16 * PAGE  # 16 entries of A, or 4 of B


def walk_tier(pool_bytes: int, slab_bytes: int) -> DramTier:
    """A tier with the reference policy (`pool.room.WalkOldest`)."""
    return DramTier(pool_bytes, slab_bytes, room=WalkOldest())


def new_tier(cls, num_slabs: int) -> DramTier:
    tier = cls(num_slabs * SLAB, SLAB)
    tier.add_namespace(NS_A, PAGE)
    tier.add_namespace(NS_B, 4 * PAGE)
    tier.add_namespace(NS_C, 2 * PAGE)
    return tier


def put(tier: DramTier, ns: str, key: bytes) -> DramEntry:
    entry = tier.reserve(ns, key)
    assert entry is not None, f"no slot for {key!r}"
    assert tier.commit(entry)
    return entry


def pinned_in_every_slab(cls, num_slabs: int) -> DramTier:
    """Half the slabs full of A (older), half full of B; one entry of every slab pinned."""
    tier = new_tier(cls, num_slabs)
    slabs: dict[int, DramEntry] = {}
    for i in range(num_slabs // 2 * 16):
        entry = put(tier, NS_A, b"a%d" % i)
        slabs.setdefault(tier.alloc.slab_of(entry.offset), entry)
    for i in range(num_slabs // 2 * 4):
        entry = put(tier, NS_B, b"b%d" % i)
        slabs.setdefault(tier.alloc.slab_of(entry.offset), entry)
    assert len(slabs) == num_slabs and tier.alloc.num_free_slabs == 0
    for entry in slabs.values():
        tier.pin(entry)
    return tier


@pytest.fixture
def stamp_reads(monkeypatch) -> list[int]:
    """Counts every read of an entry's LRU stamp: what ordering entries by age costs."""
    slot = DramEntry.stamp
    reads = [0]

    class Counting:
        def __get__(self, obj, cls=None):
            if obj is None:
                return self
            reads[0] += 1
            return slot.__get__(obj, cls)

        def __set__(self, obj, value):
            slot.__set__(obj, value)

    monkeypatch.setattr(DramEntry, "stamp", Counting())
    return reads


@pytest.mark.parametrize("num_slabs", [16, 64])
def test_a_reserve_behind_a_pinned_entry_in_every_slab_costs_the_same_whatever_the_pool_holds(num_slabs, stamp_reads):
    tier = pinned_in_every_slab(DramTier, num_slabs)
    stamp_reads[0] = 0

    for i in range(128):
        put(tier, NS_B, b"new%d" % i)  # each one evicts B's own oldest: no slab of A may move

    assert tier.stats().slab_moves == 0
    # The walk read the stamp of every entry of A (8 x 16 or 32 x 16 of them) for every key.
    assert stamp_reads[0] <= 128 * 8, f"{stamp_reads[0]} stamp reads for 128 keys in {num_slabs} slabs"


def test_a_reserve_that_finds_no_room_anywhere_gives_up_at_once(stamp_reads):
    tier = new_tier(DramTier, 64)
    a = [put(tier, NS_A, b"a%d" % i) for i in range(32 * 16)]
    c = [put(tier, NS_C, b"c%d" % i) for i in range(32 * 8)]
    for entry in a[::16] + c[::8]:
        tier.pin(entry)
    stamp_reads[0] = 0

    assert all(tier.reserve(NS_B, b"b%d" % i) is None for i in range(128))

    assert tier.stats().reserve_failures == 128
    assert stamp_reads[0] <= 128 * 8, f"{stamp_reads[0]} stamp reads for 128 failed keys"


def test_the_slab_that_moves_is_the_one_the_walk_would_have_moved():
    # Slab of a0..a15 holds a pinned entry; the next slab of A is all free: it goes, although
    # its entries are younger than those of the blocked one.
    tier = new_tier(DramTier, 3)
    a = [put(tier, NS_A, b"a%d" % i) for i in range(32)]
    put(tier, NS_B, b"b0")
    tier.pin(a[3])
    for i in range(3):
        put(tier, NS_B, b"b%d" % (i + 1))

    newcomer = put(tier, NS_B, b"b4")

    assert tier.alloc.slab_of(newcomer.offset) == tier.alloc.slab_of(a[16].offset)
    assert set(tier.index_of(NS_A)) == {b"a%d" % i for i in range(16)}
    assert tier.stats().slab_moves == 1


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_evicts_exactly_what_the_walk_evicts(seed):
    """Seeds 3 to 5 start with one size class and add the others later (the tier keeps its
    slabs' books from the second one on)."""
    rng = random.Random(seed)
    late = seed >= 3
    fast, walk = (
        (DramTier(6 * SLAB, SLAB), walk_tier(6 * SLAB, SLAB))
        if late
        else (new_tier(DramTier, 6), new_tier(walk_tier, 6))
    )
    if late:
        fast.add_namespace(NS_A, PAGE)
        walk.add_namespace(NS_A, PAGE)
    pinned: list[tuple[str, bytes]] = []
    reserved: list[tuple[str, bytes]] = []
    for step in range(3000):
        if late and step == 1000:
            for t in (fast, walk):
                t.add_namespace(NS_B, 4 * PAGE)
                t.add_namespace(NS_C, 2 * PAGE)
        ns = rng.choice((NS_A, NS_A, NS_B, NS_C)) if not late or step >= 1000 else NS_A
        key = b"k%d" % rng.randrange(150)
        op = rng.random()
        if op < 0.5:
            got = [t.reserve(ns, key) for t in (fast, walk)]
            assert (got[0] is None) == (got[1] is None), f"step {step}"
            if got[0] is not None:
                assert got[0].offset == got[1].offset, f"step {step}"
                if rng.random() < 0.1:
                    reserved.append((ns, key))
                else:
                    assert [t.commit(e) for t, e in zip((fast, walk), got)] == [True, True]
        elif op < 0.6 and reserved:
            ns, key = reserved.pop(rng.randrange(len(reserved)))
            publish = rng.random() < 0.5
            for t in (fast, walk):
                entry = t.get(ns, key)
                if entry is not None and entry.reserved:
                    t.commit(entry) if publish else t.abort(entry)
        elif op < 0.75:
            for t in (fast, walk):
                entry = t.get(ns, key)
                if entry is not None and entry.ready:
                    t.touch(entry)
        elif op < 0.85:
            if all(t.get(ns, key) is not None for t in (fast, walk)):
                for t in (fast, walk):
                    t.pin(t.get(ns, key))
                pinned.append((ns, key))
        elif op < 0.97 and pinned:
            ns, key = pinned.pop(rng.randrange(len(pinned)))
            for t in (fast, walk):
                t.unpin(next(e for e in t._by_offset.values() if e.ns == ns and e.key == key and e.refs))
        elif op >= 0.995:
            for t in (fast, walk):
                t.drop(ns)
        for ns_ in (NS_A, NS_B, NS_C) if not late or step >= 1000 else (NS_A,):
            assert {k: e.offset for k, e in fast.index_of(ns_).items()} == {
                k: e.offset for k, e in walk.index_of(ns_).items()
            }, f"step {step}"
    assert fast.stats() == walk.stats()
    assert fast.stats().slab_moves > 0
