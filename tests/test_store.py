"""Stories about the tiered store: DRAM before storage, two-phase writes, leases, promotion,
owners that vanish, clearing, and the storage hit after a restart."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import math
import os
import platform
import threading
import time
from pathlib import Path

import pytest

from helpers.clock import FakeClock
from helpers.config import make_pool_config, make_storage_config
from hpkv.config import StorageConfig
from hpkv.keys import NamespaceDesc, make_key
from hpkv.store import PrefixOrder, StorePolicy, TieredStore, create_store
from hpkv.tiers import Tier

ENTRY = 64 << 10


def desc(model: str = "tiny", entry_bytes: int = ENTRY, rank: int = 0) -> NamespaceDesc:
    return NamespaceDesc(
        engine="test",
        model=model,
        dtype="float16",
        layout="blocks",
        block_size=32,
        num_layers=2,
        entry_bytes=entry_bytes,
        rank=rank,
    )


def keys(n: int, prefix: str = "req") -> list[bytes]:
    return [make_key(hashlib.sha256(f"{prefix}-{i}".encode()).digest()) for i in range(n)]


def payload(key: bytes, size: int = ENTRY) -> bytes:
    block = hashlib.blake2b(key).digest()
    return (block * (size // len(block) + 1))[:size]


def save(store: TieredStore, ns: str, ks: list[bytes]) -> int:
    offsets = store.reserve(ns, ks)
    for key, offset in zip(ks, offsets):
        if offset is not None:
            store.region.buf[offset : offset + store.namespaces()[ns].entry_bytes] = payload(
                key, store.namespaces()[ns].entry_bytes
            )
    return store.commit(ns, ks)


def only_in_storage(store: TieredStore, ns: str, ks: list[bytes]) -> None:
    """Save `ks`, wait for their files, and empty DRAM: they are storage hits now."""
    save(store, ns, ks)
    assert store.flush(timeout=10)
    store.clear(dram=True)


def load(store: TieredStore, ns: str, ks: list[bytes]) -> list[bytes]:
    lease = store.lease(ns, ks)
    try:
        num_ready = lease.wait(timeout=10)
        size = store.namespaces()[ns].entry_bytes
        return [bytes(store.region.buf[o : o + size]) for o in lease.offsets[:num_ready]]
    finally:
        store.release(lease.id)


@pytest.fixture
def open_store(shm_dir, storage_dir):
    stores = []

    def _open(
        pool_bytes: int = 16 << 20,
        capacity: int | None = None,
        storage: StorageConfig | None = None,
        pool_dir: Path | None = None,
        policy: StorePolicy | None = None,
    ) -> TieredStore:
        store = create_store(
            make_pool_config(pool_dir or shm_dir, pool_bytes),
            storage or make_storage_config(storage_dir, capacity),
            policy=policy,
        )
        stores.append(store)
        return store

    yield _open
    for store in stores:
        if store.region._fd >= 0:
            store.close()


def test_a_saved_prefix_hits_in_dram_and_loads_the_same_bytes(open_store):
    store = open_store()
    ns = store.register(desc())
    ks = keys(8)
    assert save(store, ns, ks) == 8
    hit = store.lookup(ns, ks + keys(2, "other"))
    assert hit.num_hit == 8 and hit.num_dram == 8
    assert load(store, ns, ks) == [payload(k) for k in ks]


def test_lookup_stops_at_the_first_miss(open_store):
    store = open_store()
    ns = store.register(desc())
    ks = keys(6)
    save(store, ns, ks[:2] + ks[3:])
    assert store.lookup(ns, ks).num_hit == 2


def test_uncommitted_entries_are_invisible_to_lookups_and_leases(open_store):
    store = open_store()
    ns = store.register(desc())
    ks = keys(3)
    store.reserve(ns, ks)
    assert store.lookup(ns, ks).num_hit == 0
    lease = store.lease(ns, ks)
    assert lease.wait() == 0
    store.release(lease.id)
    store.abort(ns, ks)
    assert store.stats().dram.num_entries == 0


def test_nothing_is_saved_twice(open_store):
    store = open_store()
    ns = store.register(desc())
    ks = keys(4)
    save(store, ns, ks[:2])
    offsets = store.reserve(ns, ks)
    assert offsets[:2] == [None, None] and None not in offsets[2:]
    store.abort(ns, ks)


def test_a_key_reserved_again_before_its_commit_keeps_its_first_slot(open_store):
    """An owner that reserves a key it has not committed yet (listed twice in one request, or a
    later step's save before the saver thread commits the first) may still be copying into the
    first slot: that slot must not go to anybody else, and the commit must publish those bytes."""
    store = open_store(pool_bytes=1 << 20)  # 16 slots
    ns = store.register(desc())
    k, other = keys(1)[0], keys(15, "other")
    (first,) = store.reserve(ns, [k], owner=1)
    assert store.reserve(ns, [k, k], owner=1) == [None, None]
    store.region.buf[first : first + ENTRY] = payload(k)  # the owner's copy lands in its first slot
    taken = store.reserve(ns, other, owner=2)  # every other slot
    assert None not in taken and first not in taken
    assert store.commit(ns, [k, k], owner=1) == 1
    assert load(store, ns, [k]) == [payload(k)]
    store.abort(ns, other, owner=2)


def test_a_hold_is_committed_by_its_settler_for_every_owner_but_the_keys_it_aborts(open_store):
    """Two workers (owners) reserve in one hold and copy; neither commits. The settler commits
    the hold but one key, which is aborted in both namespaces and can be saved again."""
    store = open_store()
    ns0, ns1 = store.register(desc(rank=0)), store.register(desc(rank=1))
    good, bad = keys(2), keys(1, "bad")
    for owner, ns in ((1, ns0), (2, ns1)):
        offsets = store.reserve(ns, good + bad, owner=owner, hold="step-7")
        for key, offset in zip(good + bad, offsets):
            store.region.buf[offset : offset + ENTRY] = payload(key)
    assert store.lookup(ns0, good).num_hit == 0  # held: not published by the copy alone,
    assert store.commit(ns0, good, owner=1) == 0  # nor by its owner (only the settler knows)
    store.abort(ns0, good, owner=1)

    assert store.settle("step-7", abort=bad) == (4, 2)

    for ns in (ns0, ns1):
        assert store.lookup(ns, good + bad).num_hit == 2
        assert load(store, ns, good) == [payload(k) for k in good]
        assert store.reserve(ns, bad, owner=1) != [None]  # aborted: free to be saved again
        store.abort(ns, bad, owner=1)
    assert store.settle("step-7", abort=[]) == (0, 0)  # once only
    assert store.stats().holds == 0


def test_an_owner_gives_back_what_it_reserved_in_a_hold_and_the_settle_cannot_publish_it(open_store):
    """A worker whose copy failed gives its held slots back; the scheduler's settle, which knows
    nothing of that, must not publish them."""
    store = open_store()
    ns = store.register(desc())
    ks = keys(2)
    store.reserve(ns, ks, owner=1, hold="h")
    assert store.abort(ns, ks, owner=1) == 0  # not without naming the hold
    assert store.abort(ns, ks[:1], owner=1, hold="h") == 1

    assert store.settle("h", abort=[]) == (1, 0)
    assert store.lookup(ns, ks).num_hit == 0 and store.lookup(ns, ks[1:]).num_hit == 1


def test_a_hold_nobody_settles_is_aborted_after_the_timeout(open_store):
    from hpkv.store import HOLD_QUARANTINE_S
    from hpkv.tiers import HOLD_TIMEOUT_S

    store = open_store()
    clock = store.limits.clock = FakeClock(time.monotonic())  # what was held before keeps its age
    ns = store.register(desc())
    ks = keys(3)
    store.reserve(ns, ks, owner=1, hold="forgotten")
    store.reserve(ns, keys(1, "late"), owner=1, hold="late")
    clock.now += HOLD_TIMEOUT_S
    store.reserve(ns, keys(1, "later"), owner=2, hold="late")  # ends holds past their time, but this one

    stats = store.stats()
    assert stats.holds == 1 and stats.quarantined == 3  # "late" is kept: an owner joins it now
    assert store.settle("forgotten", abort=[]) == (0, 0)
    assert store.lookup(ns, ks).num_hit == 0
    assert store.settle("late", abort=None) == (0, 2)
    clock.now += HOLD_QUARANTINE_S - 1
    store.reserve(ns, [], owner=3)
    assert store.stats().quarantined == 3
    clock.now += 1
    store.reserve(ns, [], owner=3)
    assert store.stats().quarantined == 0 and store.reserve(ns, ks, owner=3) != [None] * 3


def test_a_hold_whose_owner_is_gone_settles_nothing_of_it(open_store):
    store = open_store()
    ns = store.register(desc())
    ks = keys(2)
    store.reserve(ns, ks, owner=1, hold="h")
    store.drop_owner(1)

    assert store.settle("h", abort=[]) == (0, 0)
    assert store.lookup(ns, ks).num_hit == 0
    assert store.stats().dram.used_bytes == 0


def test_a_key_cleared_while_reserved_keeps_its_slot_until_the_owner_lets_go(open_store):
    store = open_store(pool_bytes=1 << 20)  # 16 slots
    ns = store.register(desc())
    k, other = keys(1)[0], keys(16, "other")
    (first,) = store.reserve(ns, [k], owner=1)
    store.clear(dram=True)
    assert store.reserve(ns, [k], owner=1) == [None]
    assert first not in store.reserve(ns, other, owner=2)  # fifteen slots left for sixteen keys
    assert store.commit(ns, [k], owner=1) == 0  # dropped by the clear: not published, slot freed
    assert store.lookup(ns, [k]).num_hit == 0
    assert store.reserve(ns, [k], owner=1) == [first]


def test_a_key_cleared_while_reserved_in_a_hold_is_not_reserved_twice_in_it(open_store):
    """A worker reserves a key in a hold, a clear drops the entry while the worker may still be
    copying, and the same worker reserves the key in that hold again: it gets no second slot
    (which would orphan the first), and once the hold is settled every slot is free again."""
    store = open_store(pool_bytes=1 << 20)
    ns = store.register(desc())
    k = keys(1)[0]
    assert store.reserve(ns, [k], owner=1, hold="h") != [None]
    store.clear(dram=True)

    assert store.reserve(ns, [k], owner=1, hold="h") == [None]

    assert store.settle("h", abort=[]) == (0, 0)  # dropped by the clear: not published, slot freed
    store.drop_owner(1)
    assert store.stats().dram.used_bytes == 0


def test_commits_are_written_through_and_survive_a_dram_clear(open_store):
    store = open_store()
    ns = store.register(desc())
    ks = keys(5)
    only_in_storage(store, ns, ks)
    hit = store.lookup(ns, ks)
    assert hit.tiers == (Tier.STORAGE,) * 5
    assert load(store, ns, ks) == [payload(k) for k in ks]
    assert store.lookup(ns, ks).tiers == (Tier.DRAM,) * 5  # promoted for loading


def test_a_lease_can_answer_before_its_storage_reads_are_queued(open_store):
    store = open_store()
    ns = store.register(desc())
    ks = keys(4)
    only_in_storage(store, ns, ks)
    lease = store.lease(ns, ks, start_reads=False)
    assert len(lease.offsets) == 4 and not lease.done
    assert store.counters.promotions == 4 and store.storage.stats().reads == 0
    store.leases.start_reads(lease)
    assert lease.wait(timeout=10) == 4
    size = store.namespaces()[ns].entry_bytes
    assert [bytes(store.region.buf[o : o + size]) for o in lease.offsets] == [payload(k) for k in ks]
    store.release(lease.id)


def test_a_storage_hit_leased_for_promotion_is_not_evicted_before_its_read(open_store):
    """A lease makes its storage hits the most recently used on storage: writes that run before
    the promotion reads the file evict others, not the file the lease was promised."""
    from hpkv.storage import format as fmt

    ks, more = keys(4), keys(1, "more")
    store = open_store(capacity=4 * (fmt.header_bytes(len(ks[0])) + ENTRY))  # four files
    ns = store.register(desc())
    only_in_storage(store, ns, ks)
    for k in ks[1:]:  # ks[0] is now the least recently used on storage
        assert store.storage.read_into(ns, k, memoryview(bytearray(ENTRY)))
    lease = store.lease(ns, ks[:1], start_reads=False)

    save(store, ns, more)  # its write-through needs room on storage
    assert store.flush(timeout=10)
    store.leases.start_reads(lease)

    assert lease.wait(timeout=10) == 1
    assert bytes(store.region.buf[lease.offsets[0] : lease.offsets[0] + ENTRY]) == payload(ks[0])
    store.release(lease.id)
    assert store.storage.stats().evictions == 1 and not store.storage.indexed(ns, ks[1])


def test_of_a_prefix_leased_from_storage_none_is_evicted_before_it_is_read(open_store):
    """The storage hits a lease promotes are not evicted before they are read (the capacity
    holds one file more meanwhile), and the next write after brings the tier back within it."""
    from hpkv.storage import format as fmt

    ks, more, later = keys(4), keys(1, "more"), keys(1, "later")
    capacity = 4 * (fmt.header_bytes(len(ks[0])) + ENTRY)  # four files
    store = open_store(capacity=capacity)
    ns = store.register(desc())
    only_in_storage(store, ns, ks)
    lease = store.lease(ns, ks, start_reads=False)

    save(store, ns, more)  # its write-through needs room on storage
    assert store.flush(timeout=10)

    assert [store.storage.indexed(ns, k) for k in ks] == [True] * 4
    store.leases.start_reads(lease)
    assert lease.wait(timeout=10) == 4
    store.release(lease.id)
    save(store, ns, later)
    assert store.flush(timeout=10)
    assert store.stats().storage.used_bytes <= capacity and store.storage.indexed(ns, later[0])


def test_a_lease_touches_its_storage_hits_before_looking_for_files_elsewhere(open_store):
    """Looking for a key's file elsewhere is a stat (slow on Lustre): the hits found before it
    are made the most recently used first, so that writes meanwhile do not evict them; at the
    end, all of them last key first."""
    ks = keys(4)
    store = open_store()
    ns = store.register(desc())
    only_in_storage(store, ns, ks)
    store.storage.index.forget(store.storage.index.key(ns, ks[2]))  # written by another node, say: found by a stat
    events = []
    touch, found_elsewhere = store.storage.touch, store.lookups.found_elsewhere
    store.storage.touch = lambda ns_, touched, **kw: (
        events.append(("touch", list(touched))),
        touch(ns_, touched, **kw),
    )
    store.lookups.found_elsewhere = lambda *args: (events.append(("stat",)), found_elsewhere(*args))[1]

    lease = store.lease(ns, ks)

    assert lease.wait(timeout=10) == 4
    store.release(lease.id)
    assert events[:2] == [("touch", [ks[1], ks[0]]), ("stat",)]
    assert events[-1] == ("touch", ks[::-1])


def test_a_lease_waiting_for_the_storage_index_does_not_hold_up_lookups(open_store):
    """The storage tier's lock is held for long stretches (an eviction popping many files, a
    remove walking its index): a lease that waits for it must not hold the store's lock."""
    stored, in_dram = keys(4), keys(2, "dram")
    store = open_store()
    ns = store.register(desc())
    only_in_storage(store, ns, stored)
    save(store, ns, in_dram)
    assert store.flush(timeout=10)
    looked_up = threading.Event()

    def lookup() -> None:
        assert store.lookup(ns, in_dram).num_dram == 2
        looked_up.set()

    with store.storage._lock:  # busy, as an eviction keeps it
        leasing = threading.Thread(target=store.lease, args=(ns, stored), kwargs={"start_reads": False})
        leasing.start()
        time.sleep(0.3)  # the lease has pinned its entries and waits for the tier
        threading.Thread(target=lookup, daemon=True).start()
        answered = looked_up.wait(5)
    leasing.join(10)

    assert answered
    assert store.stats().leases == 1


def test_a_promotion_whose_pool_is_gone_resolves_as_a_miss(open_store):
    """A promotion that cannot even see its slot (the pool closed under it, as a close that gave
    up its writes does) still resolves: its lease's untimed waits end, with nothing ready."""
    store = open_store()
    ns = store.register(desc())
    ks = keys(2)
    only_in_storage(store, ns, ks)
    lease = store.lease(ns, ks, start_reads=False)
    store.region.buf.release()  # what region.close() does first

    store.leases.start_reads(lease)

    assert lease.wait(timeout=10) == 0
    assert lease.done and store.stats().store.promotion_failures == 2
    store.storage.close()


def no_fallocate(monkeypatch) -> None:
    """posix_fallocate as a C library that does not emulate it (musl) has it on ramfs: refused."""
    import errno

    def refused(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", refused)


def store_with_auto_storage_on(point: Path, pool_bytes: int) -> TieredStore:
    """A store whose pool and automatically sized storage are both under `point`, its
    start-up scan done."""
    store = create_store(make_pool_config(point / "pool", pool_bytes), make_storage_config(point / "storage", None))
    assert store.storage.scan_done.wait(10)
    return store


@pytest.mark.parametrize("fallocate", ["emulated", "refused"])
def test_storage_on_ramfs_beside_a_pool_on_ramfs_leaves_the_pool_its_memory(tmp_path, monkeypatch, fallocate):
    """The quick start puts pool and storage on one ramfs, which has no fallocate: where the C
    library does not emulate it by touching every page, the pool is only sized when the storage
    tier starts, its pages come on first touch, and the memory available still counts them. An
    automatic capacity that took half of them too left the pool's pages nowhere to come from: the
    tier leaves out what the pool has not taken yet (all of it, or none once its pages are in)."""
    from helpers.machine import GIB, pretend

    point = tmp_path / "ram"
    pretend(monkeypatch, tmp_path, 8 * GIB, ramfs=(point,))
    if fallocate == "refused":
        no_fallocate(monkeypatch)
    pool_bytes = 64 << 20
    store = store_with_auto_storage_on(point, pool_bytes)
    try:
        to_come = pool_bytes if fallocate == "refused" else 0
        assert store.storage.capacity.capacity_bytes == int((8 * GIB - to_come) // 2 * 0.8)
    finally:
        store.close()


@pytest.mark.parametrize("fallocate", ["emulated", "refused"])
def test_storage_on_a_real_ramfs_beside_a_pool_on_it_leaves_the_pool_its_memory(tmp_path, monkeypatch, fallocate):
    """As above, on a real ramfs (needs root), with the memory available fixed (the machine's
    moves by a GiB in a second, others' work): the pool's pages not taken yet are left out, and
    those glibc's posix_fallocate touched are not left out twice."""
    import subprocess

    from helpers.machine import GIB, pretend

    point = tmp_path / "ramfs"
    point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "ramfs", "-o", "mode=0700", "ramfs", str(point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a ramfs (needs root): {mounted.stderr.strip()}")
    try:
        pretend(monkeypatch, tmp_path, 8 * GIB)
        if fallocate == "refused":
            no_fallocate(monkeypatch)
        pool_bytes = 64 << 20
        store = store_with_auto_storage_on(point, pool_bytes)
        try:
            to_come = store.region.unbacked_bytes()
            if fallocate == "refused":
                assert to_come == pool_bytes
            elif platform.libc_ver()[0] == "glibc":  # its posix_fallocate emulated on ramfs touched every page
                assert to_come == 0
            else:  # another C library's refuses, or emulates it
                assert to_come in (0, pool_bytes)
            assert store.storage.capacity.capacity_bytes == int((8 * GIB - to_come) // 2 * 0.8)
        finally:
            store.close()
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True)


def test_a_close_that_gives_up_its_writes_resolves_the_promotions_it_drops_as_misses(open_store, storage_dir):
    """A close that gives up its writes (storage stopped answering) drops the storage reads
    still queued too: their promotions resolve, as misses, so nothing waits on them for ever."""
    store = open_store(storage=make_storage_config(storage_dir, None, io_threads=1))
    ns = store.register(desc())
    stored = keys(2, "stored")
    only_in_storage(store, ns, stored)
    gate = threading.Event()
    store.storage.publish_many = lambda *args: gate.wait(30)  # the device hangs
    store.storage.read_into = lambda *args: gate.wait(30) and False
    save(store, ns, keys(1, "busy"))  # its write-through hangs
    lease = store.lease(ns, stored)  # the last key's read hangs on the one I/O thread, the first's waits for it
    give_up = threading.Event()
    give_up.set()
    try:
        assert store.close(abandon=give_up)

        assert lease.promotions[0].result(timeout=5) is False
        assert lease.wait(timeout=1) == 0
    finally:
        gate.set()


def test_a_promotion_does_not_queue_behind_write_throughs(open_store):
    store = open_store(pool_bytes=64 << 20)
    ns = store.register(desc())
    stored = keys(4, "stored")
    only_in_storage(store, ns, stored)
    gate = threading.Event()
    original = store.storage.publish_many

    def held_write(*args):  # every write-through waits until the promotion below is done
        gate.wait(10)
        return original(*args)

    store.storage.publish_many = held_write
    try:
        save(store, ns, keys(3 * store.storage.config.io_threads, "busy"))  # more than all I/O threads
        assert load(store, ns, stored) == [payload(k) for k in stored]
    finally:
        gate.set()
    assert store.flush(timeout=10)


def test_write_throughs_use_few_threads_on_a_small_machine():
    from hpkv.store import write_threads

    assert write_threads(8, cpus=2) == 2  # the GIL is shared with the server's request handlers
    assert write_threads(8, cpus=64) == 8
    assert write_threads(1, cpus=2) == 1  # never more than HPKV_IO_THREADS


def test_a_lease_wait_timeout_bounds_the_whole_wait():
    from concurrent.futures import Future
    from concurrent.futures import TimeoutError as FutureTimeout
    from types import SimpleNamespace

    from hpkv.store import Lease

    promotions = [Future() for _ in range(20)]  # each done 0.05 s after the one before

    def finish() -> None:
        for promotion in promotions:
            time.sleep(0.05)
            promotion.set_result(True)

    lease = Lease(1, "ns", 0, [SimpleNamespace(offset=i) for i in range(20)], promotions)
    threading.Thread(target=finish, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(FutureTimeout):
        lease.wait(timeout=0.2)  # each promotion alone is quicker than that; all 20 are not
    assert time.monotonic() - started < 0.5


def test_dram_hits_are_listed_before_storage_hits_in_one_prefix(open_store):
    store = open_store()
    ns = store.register(desc())
    ks = keys(4)
    save(store, ns, ks)
    store.flush(timeout=10)
    store.clear(dram=True)
    load(store, ns, ks[:2])  # the first two come back into DRAM
    assert store.lookup(ns, ks).tiers == (Tier.DRAM, Tier.DRAM, Tier.STORAGE, Tier.STORAGE)


def test_a_restarted_store_finds_its_storage_entries(open_store, shm_dir):
    store = open_store()
    ns = store.register(desc())
    ks = keys(6)
    save(store, ns, ks)
    store.close()  # waits for the write-through, removes the pool: DRAM is gone
    assert not any(shm_dir.iterdir())

    again = open_store()
    ns2 = again.register(desc())
    assert ns2 == ns
    assert again.lookup(ns, ks).tiers == (Tier.STORAGE,) * 6
    assert load(again, ns, ks) == [payload(k) for k in ks]


def test_a_corrupted_file_ends_the_loaded_prefix_and_is_removed(open_store, storage_dir):
    store = open_store()
    ns = store.register(desc())
    ks = keys(4)
    save(store, ns, ks)
    store.flush(timeout=10)
    store.clear(dram=True)
    bad = store.storage.paths.path_of(ns, ks[2])
    with open(bad, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\x00" * 8)
    assert load(store, ns, ks) == [payload(k) for k in ks[:2]]
    assert not os.path.exists(bad)
    assert store.lookup(ns, ks).num_hit == 2
    assert store.stats().store.promotion_failures == 1


def test_the_same_key_in_another_namespace_is_another_entry(open_store):
    store = open_store()
    ns_a = store.register(desc(rank=0))
    ns_b = store.register(desc(rank=1))
    ks = keys(3)
    save(store, ns_a, ks)
    assert ns_a != ns_b
    assert store.lookup(ns_b, ks).num_hit == 0


def test_a_lease_keeps_its_entries_through_pressure(open_store):
    store = open_store(pool_bytes=4 << 20)  # 1 MiB slabs: 16 entries of 64 KiB per slab
    ns = store.register(desc())
    first = keys(4, "first")
    save(store, ns, first)
    lease = store.lease(ns, first)
    for round_ in range(5):
        save(store, ns, keys(16, f"pressure-{round_}"))
        store.flush(timeout=10)  # written through, so no longer pinned by the writer
    assert [bytes(store.region.buf[o : o + ENTRY]) for o in lease.offsets] == [payload(k) for k in first]
    assert store.stats().dram.evictions > 0
    store.release(lease.id)


def dram_prefix(store: TieredStore, ns: str, ks: list[bytes]) -> int:
    """How many leading keys of the prefix `ks` are in DRAM (a lookup stops at the first miss)."""
    tiers = store.lookup(ns, ks).tiers
    return next((i for i, tier in enumerate(tiers) if tier is not Tier.DRAM), len(tiers))


def storage_off(storage_dir: Path) -> StorageConfig:
    return dataclasses.replace(make_storage_config(storage_dir), enabled=False)


def test_of_a_prefix_that_fills_the_pool_the_last_entries_are_evicted_first(open_store, storage_dir):
    """vLLM frees a request's blocks last first, so that eviction leaves a usable prefix; so
    does HPKV: evicting a prefix's first entry would make every entry after it useless."""
    store = open_store(pool_bytes=4 << 20, storage=storage_off(storage_dir))  # 64 entries of 64 KiB
    ns = store.register(desc())
    chain = keys(64, "document")
    assert save(store, ns, chain) == 64

    save(store, ns, keys(8, "other"))

    assert store.stats().dram.evictions == 8
    assert dram_prefix(store, ns, chain) == 56


def test_a_prefix_read_together_keeps_its_first_entries_longest(open_store, storage_dir):
    store = open_store(pool_bytes=4 << 20, storage=storage_off(storage_dir))
    ns = store.register(desc())
    chain, other = keys(48, "document"), keys(16, "other")
    save(store, ns, other)
    save(store, ns, chain)
    assert load(store, ns, other) == [payload(k) for k in other]  # now the chain is the older of the two
    assert load(store, ns, chain) == [payload(k) for k in chain]  # and now the other keys are

    save(store, ns, keys(24, "new"))

    assert dram_prefix(store, ns, other) == 0  # all 16 evicted: the least recently used
    assert dram_prefix(store, ns, chain) == 40  # then the chain's last 8, not its first


def test_written_through_prefixes_leave_dram_last_entries_first(open_store):
    store = open_store(pool_bytes=4 << 20)  # with the storage tier: unpinned as each file lands
    ns = store.register(desc())
    chain = keys(64, "document")
    save(store, ns, chain)
    assert store.flush(timeout=20)

    save(store, ns, keys(8, "other"))
    assert store.flush(timeout=20)

    lookup = store.lookup(ns, chain)
    assert lookup.num_hit == 64  # the evicted entries are on storage
    # Two write-through threads finish in about the order they were given, last first.
    assert 48 <= dram_prefix(store, ns, chain) <= 56 and lookup.num_dram == 56


def test_a_vanished_owner_loses_its_reservations_and_leases(open_store):
    store = open_store()
    ns = store.register(desc())
    saved, pending = keys(2, "saved"), keys(3, "pending")
    save(store, ns, saved)
    store.reserve(ns, pending, owner=7)
    store.lease(ns, saved, owner=7)
    assert store.stats().reservations == 3 and store.stats().leases == 1
    store.drop_owner(7)
    stats = store.stats()
    assert stats.reservations == 0 and stats.leases == 0
    assert store.commit(ns, pending, owner=7) == 0
    assert store.lookup(ns, pending).num_hit == 0


def test_the_slots_of_a_dropped_live_writer_stay_unusable_for_the_quarantine(open_store):
    store = open_store()
    ns = store.register(desc())
    pending = keys(3, "pending")
    store.reserve(ns, pending, owner=7)
    store.drop_owner(7, quarantine_s=0.3)
    stats = store.stats()
    assert stats.reservations == 0 and stats.quarantined == 3
    assert store.reserve(ns, pending, owner=8) == [None] * 3  # its late bytes may still land there
    assert store.commit(ns, pending, owner=7) == 0
    time.sleep(0.35)
    assert None not in store.reserve(ns, pending, owner=8)
    assert store.stats().quarantined == 0


def test_commit_only_publishes_what_the_owner_reserved(open_store):
    store = open_store()
    ns = store.register(desc())
    ks = keys(2)
    store.reserve(ns, ks, owner=1)
    assert store.commit(ns, ks, owner=2) == 0
    assert store.commit(ns, ks, owner=1) == 2


def test_clear_memory_of_one_namespace_leaves_the_other(open_store):
    store = open_store()
    ns_a = store.register(desc(model="a"))
    ns_b = store.register(desc(model="b"))
    ks = keys(3)
    save(store, ns_a, ks)
    save(store, ns_b, ks)
    store.flush(timeout=10)
    store.clear(dram=True, ns=ns_a)
    assert store.lookup(ns_a, ks).tiers == (Tier.STORAGE,) * 3
    assert store.lookup(ns_b, ks).tiers == (Tier.DRAM,) * 3


def test_clear_storage_leaves_dram(open_store):
    store = open_store()
    ns = store.register(desc())
    ks = keys(3)
    save(store, ns, ks)
    store.flush(timeout=10)
    removed = store.clear(dram=False, storage=True)
    assert removed["storage"] == 3
    assert store.lookup(ns, ks).tiers == (Tier.DRAM,) * 3
    store.clear(dram=True)
    assert store.lookup(ns, ks).num_hit == 0


def test_with_storage_disabled_entries_live_in_dram_only(open_store, storage_dir):
    store = open_store(
        storage=StorageConfig(path=storage_dir, enabled=False, capacity_bytes=None, fsync="off", io_threads=1)
    )
    ns = store.register(desc())
    ks = keys(3)
    save(store, ns, ks)
    assert store.storage is None
    assert store.lookup(ns, ks).num_dram == 3
    assert not any(storage_dir.iterdir())


def test_counters_follow_what_happened(open_store):
    store = open_store()
    ns = store.register(desc())
    ks = keys(4)
    save(store, ns, ks)
    store.flush(timeout=10)
    store.lookup(ns, ks)
    stats = store.stats()
    assert stats.store.commits == 4
    assert stats.store.hit_keys_dram == 4
    assert stats.storage.writes == 4
    assert stats.storage.write_bytes == 4 * ENTRY


def test_the_namespace_is_described_in_plain_text_beside_its_files(open_store, storage_dir):
    store = open_store()
    d = desc(model="qwen2.5-1.5b")
    ns = store.register(d)
    text = (storage_dir / ns / "namespace.json").read_text()
    assert NamespaceDesc.from_json(text) == d
    assert "qwen2.5-1.5b" in text


def test_a_slow_storage_stat_does_not_hold_up_other_clients(shm_dir, storage_dir):
    """A lookup that misses asks the storage directory for a file another node may have written:
    one `stat`, a round trip on a network file system, or a hang. It runs outside the store's
    lock, so other clients' lookups and saves go on meanwhile."""
    from hpkv.pool.region import PoolRegion
    from hpkv.storage.fileio import FileIO
    from hpkv.storage.storage_tier import StorageTier

    class SlowMetadataIO(FileIO):
        """Real system calls; a `stat` of a path takes a second (a busy NFS server)."""

        def stat_path(self, path: str, dir_fd: int | None = None) -> os.stat_result:
            time.sleep(1.0)
            return super().stat_path(path, dir_fd)

    tier = StorageTier(make_storage_config(storage_dir), io=SlowMetadataIO())
    tier.start()
    store = TieredStore(PoolRegion.create(shm_dir, 16 << 20), tier)
    try:
        ns = store.register(desc())
        held = keys(4)
        save(store, ns, held)
        slow = threading.Thread(target=store.lookup, args=(ns, keys(1, "elsewhere")))
        slow.start()
        time.sleep(0.2)  # the slow lookup is in its stat now
        started = time.monotonic()
        assert store.lookup(ns, held).tiers == (Tier.DRAM,) * 4
        assert save(store, ns, keys(2, "more")) == 2
        assert load(store, ns, held) == [payload(k) for k in held]
        assert time.monotonic() - started < 0.5  # not behind the other lookup's stat
        assert slow.is_alive()
        slow.join(5)
    finally:
        store.close()


def test_a_failure_sizing_the_pool_s_pages_closes_the_pool(shm_dir, storage_dir, monkeypatch):
    """create_store looks at the pool's mount after creating it: a failure there (a mount
    table that cannot be read) must not leave the pool file behind."""
    import hpkv.store.tiered as store_module
    from hpkv.pool.region import POOL_FILE_NAME

    def unreadable(path):
        raise OSError(errno.EIO, "cannot read the mount table")

    monkeypatch.setattr(store_module, "mount_of", unreadable)

    with pytest.raises(OSError):
        create_store(make_pool_config(shm_dir), make_storage_config(storage_dir))

    assert not (shm_dir / POOL_FILE_NAME).exists()


def test_a_store_that_cannot_be_built_on_its_pool_leaves_no_pool_behind(shm_dir, storage_dir):
    """A slab larger than the pool: the store is refused, and its pool file goes with it."""
    from hpkv.pool.region import POOL_FILE_NAME

    with pytest.raises(ValueError):
        create_store(make_pool_config(shm_dir), make_storage_config(storage_dir), slab_bytes=1 << 40)

    assert not (shm_dir / POOL_FILE_NAME).exists()


@pytest.mark.parametrize("order, num_left", [(PrefixOrder.LAST_FIRST, 15), (PrefixOrder.FIRST_FIRST, 0)])
def test_the_prefix_order_given_to_a_store_decides_which_end_of_a_prefix_is_evicted(
    open_store, storage_dir, order, num_left
):
    """A full pool of one prefix, then one more key: the store's own order evicts the prefix's last
    entry (15 leading hits remain); the baseline order, plain LRU in prefix order, its first (none)."""
    storage_off = dataclasses.replace(make_storage_config(storage_dir), enabled=False)
    store = open_store(pool_bytes=1 << 20, storage=storage_off, policy=StorePolicy(order=order))  # 16 slots
    ns = store.register(desc())
    ks = keys(16)
    assert save(store, ns, ks) == 16
    load(store, ns, ks)  # a lease released in the policy's order too

    assert save(store, ns, keys(1, "newcomer")) == 1

    assert store.lookup(ns, ks).num_hit == num_left


def test_the_backlog_limit_is_a_share_of_the_pool_given_to_the_store(open_store):
    store = open_store(pool_bytes=16 << 20, policy=StorePolicy(backlog_share=math.inf))  # a baseline: no limit
    assert store.stats().write_backlog.limit_bytes == math.inf
    assert StorePolicy().backlog_limit(16 << 20) == 8 << 20  # the store's own: half the pool
