"""Stories about the storage tier's capacity (`storage/capacity.py`): entries that do not fit, a full
disk or a quota met (evict a little, retry once, learn what fits, recover later), and the
automatic capacity (HPKV_KV_STORAGE_SIZE=auto) on disks and memory file systems."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from helpers import storage_stories as stories
from helpers.clock import FakeClock
from helpers.config import make_storage_config
from helpers.storage_stories import (
    NS,
    FailingIO,
    file_bytes,
    held_scan,
    key,
    mount_tmpfs,
    payload,
    read,
    temps,
    write,
)
from hpkv.storage import capacity as capacity_module
from hpkv.storage.capacity import AUTO_CAPACITY_FRACTION, CAPACITY_RECOVERY_S, auto_capacity_bytes, little_room
from hpkv.storage.storage_tier import StorageTier

open_tier, tier, small_disk = stories.open_tier, stories.tier, stories.small_disk


def test_an_entry_larger_than_the_capacity_is_not_written(open_tier):
    tier = open_tier(capacity=file_bytes() - 1)

    assert not write(tier, key(1))

    assert not os.path.exists(tier.paths.path_of(NS, key(1)))
    assert tier.stats().write_failures == 1
    assert tier.stats().evictions == 0


def test_rewriting_an_entry_does_not_count_it_twice(open_tier):
    tier = open_tier(capacity=4 * file_bytes())
    write(tier, key(1))

    write(tier, key(1))

    assert tier.stats().num_entries == 1
    assert tier.stats().used_bytes == file_bytes()


# -- a full disk or a quota -------------------------------------------------------------------


def test_a_full_disk_evicts_and_later_writes_succeed(open_tier, small_disk):
    size = 256 << 10
    tier = open_tier(root=small_disk, capacity=64 << 20)  # the tier believes it has room
    assert tier.scan_done.wait(10)

    results = [tier.write_from(NS, key(i), memoryview(payload(key(i), size))) for i in range(40)]

    stats = tier.stats()
    assert stats.space_errors > 0 and stats.evictions > 0
    assert results[-5:] == [True] * 5
    assert all(read(tier, key(i), size=size) == payload(key(i), size) for i in range(35, 40))
    assert temps(small_disk) == []


def test_a_disk_full_of_other_data_drops_the_write_without_raising(open_tier, small_disk):
    fd = os.open(small_disk / "ballast", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\1" * (64 << 10)) == 64 << 10:
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    tier = open_tier(root=small_disk, capacity=64 << 20)

    assert not tier.write_from(NS, key(1), memoryview(payload(key(1), 256 << 10)))

    assert tier.stats().write_failures == 1
    assert temps(small_disk) == []


def test_an_injected_no_space_error_evicts_and_retries(open_tier, storage_dir):
    io = FailingIO()
    tier = open_tier(io=io)
    write(tier, key(0))
    io.no_space_writes = 1

    assert write(tier, key(1))

    assert tier.stats().space_errors == 1
    assert not os.path.exists(tier.paths.path_of(NS, key(0)))  # evicted to make room
    assert read(tier, key(1)) == payload(key(1))
    assert temps(storage_dir) == []


def test_one_no_room_that_an_eviction_cures_does_not_shrink_the_tier(open_tier):
    """A Lustre OST full for a moment: the retry after a little eviction fits, so nothing is
    learned. Learning from each such error shrank the tier to one file under intermittent ones."""
    tier = open_tier(capacity=64 * file_bytes())
    assert tier.scan_done.wait(10)
    io = tier.paths.io = FailingIO()
    assert all(write(tier, key(i)) for i in range(8))

    for i in range(100, 105):
        io.no_space_writes = 1
        assert write(tier, key(i))

    stats = tier.stats()
    assert stats.capacity_bytes == 64 * file_bytes() and stats.space_errors == 5


def test_a_quota_met_teaches_the_tier_its_capacity_and_evicts_little(open_tier, caplog):
    """HPKV_KV_STORAGE_SIZE=auto on a shared file system of petabytes, under a user quota: the
    first "no room" evicts a few files (not 1% of petabytes: the whole directory, other nodes'
    files too), and the tier holds at most what fitted from then on, saying so once."""
    tier = open_tier(capacity=1 << 52)
    assert tier.scan_done.wait(10)
    io = tier.paths.io = FailingIO()
    assert all(write(tier, key(i)) for i in range(200))
    io.no_space_writes = 2  # no room even after a little eviction: the limit is real

    assert not write(tier, key("new"))

    stats = tier.stats()
    assert stats.capacity_bytes == 196 * file_bytes()
    assert stats.evictions == 4 and stats.space_errors == 2 and stats.num_entries == 196
    assert [os.path.exists(tier.paths.path_of(NS, key(i))) for i in range(6)] == [False] * 4 + [True] * 2
    said = [r.getMessage() for r in caplog.records if "has no room for more KV files" in r.getMessage()]
    assert len(said) == 1 and "HPKV_KV_STORAGE_SIZE" in said[0]
    assert all(write(tier, key(i)) for i in range(200, 210))  # within what it learned: evicted LRU, no error
    assert tier.stats().space_errors == 2 and tier.stats().used_bytes <= 196 * file_bytes()


def a_tier_that_learned_its_room(open_tier, clock: FakeClock | None = None) -> tuple[StorageTier, FailingIO]:
    """A tier sized for 64 files holding 8, whose next write met "no room" twice: it learned
    that what it held (after a little eviction) is what fits."""
    tier = open_tier(capacity=64 * file_bytes(), clock=clock)
    assert tier.scan_done.wait(10)
    io = tier.paths.io = FailingIO()
    assert all(write(tier, key(i)) for i in range(8))
    io.no_space_writes = 2
    assert not write(tier, key("new"))
    return tier, io


def test_a_learned_capacity_goes_back_to_the_size_after_a_while_without_no_room(open_tier, caplog):
    """A quota met once (others' files took the room, say) is not a capacity for good: after
    CAPACITY_RECOVERY_S without another "no room", the tier holds what it was sized to again,
    and the warning says when."""
    clock = FakeClock()
    tier, _ = a_tier_that_learned_its_room(open_tier, clock)
    assert tier.stats().capacity_bytes == 4 * file_bytes()  # what was left after a little eviction
    said = next(r.getMessage() for r in caplog.records if "has no room for more KV files" in r.getMessage())
    assert "minutes pass without such an error, when it tries that size again" in said

    clock.advance(CAPACITY_RECOVERY_S - 1)
    assert write(tier, key(100)) and tier.stats().capacity_bytes == 4 * file_bytes()  # not yet
    clock.advance(1)
    assert all(write(tier, key(i)) for i in range(101, 110))

    assert tier.stats().capacity_bytes == 64 * file_bytes()
    assert tier.stats().num_entries == 13 and tier.stats().evictions == 5


def test_a_no_room_that_an_eviction_cures_does_not_hold_off_the_recovery(open_tier):
    """Recovery counts from the last "no room" that taught something: a Lustre OST full for a
    moment every few minutes, cured by the next eviction, must not keep the tier small."""
    clock = FakeClock()
    tier, io = a_tier_that_learned_its_room(open_tier, clock)
    assert tier.stats().capacity_bytes < 64 * file_bytes()
    clock.advance(CAPACITY_RECOVERY_S / 2)
    io.no_space_writes = 1
    assert write(tier, key("cured"))  # one "no room", then room after a little eviction

    clock.advance(CAPACITY_RECOVERY_S / 2)
    assert write(tier, key("later"))
    assert tier.stats().capacity_bytes == 64 * file_bytes()


def test_a_recovery_decided_before_a_new_no_room_keeps_what_that_one_taught(open_tier):
    """A write found the learned capacity old enough to recover; before it recovers, another
    write meets "no room" twice and learns again: the recovery must not undo that."""
    clock = FakeClock()
    tier, io = a_tier_that_learned_its_room(open_tier, clock)
    clock.advance(CAPACITY_RECOVERY_S)  # a write finds it old enough to recover

    tier.capacity.no_room()  # another write meets "no room" twice meanwhile
    tier.capacity.recover()  # the first write, going on past its check

    assert tier.stats().capacity_bytes == 4 * file_bytes()


def test_no_room_while_the_start_up_scan_runs_evicts_a_little_and_learns_nothing(open_tier):
    """Mid-scan, the index holds only the files written since the start: what fitted would be
    learned as one file, and the files the scan still finds would all be evicted after it."""
    HeldScan = held_scan()
    first = open_tier()
    assert all(write(first, key(i)) for i in range(10))
    first.close()
    io = FailingIO()
    again = open_tier(cls=HeldScan, io=io)
    assert write(again, key(10))
    io.no_space_writes = 1

    assert write(again, key(11))

    assert again.stats().space_errors == 1 and again.stats().capacity_bytes == 64 * file_bytes()
    assert again.stats().evictions == 1  # key 10: all the index held
    HeldScan.gate.set()
    assert again.scan_done.wait(10)
    assert again.stats().capacity_bytes == 64 * file_bytes() and again.stats().num_entries == 11
    assert all(os.path.exists(again.paths.path_of(NS, key(i))) for i in range(10))


def test_no_room_that_one_eviction_does_not_cure_drops_the_write(open_tier):
    """A write is given up (a miss later) rather than evicting again and again."""
    io = FailingIO()
    tier = open_tier(io=io)
    assert all(write(tier, key(i)) for i in range(20))
    io.write_errno = errno.EDQUOT

    assert not write(tier, key("new"))

    stats = tier.stats()
    assert stats.evictions == 4 and stats.space_errors == 2 and stats.write_failures == 1
    assert stats.num_entries == 16


# -- the automatic capacity -------------------------------------------------------------------


def test_an_automatic_capacity_is_a_share_of_the_free_space(open_tier, small_disk):
    tier = open_tier(root=small_disk, capacity=None)
    assert tier.scan_done.wait(10)

    assert 0.7 * (4 << 20) < tier.capacity.capacity_bytes <= 0.8 * (4 << 20)


def test_an_automatic_capacity_on_ramfs_has_room_and_writes(open_tier, tmp_path, caplog):
    """The quick start puts storage on a ramfs, which says 0 free (it has no size): auto takes 80%
    of half the memory available there, KV files appear, and the log says they take RAM."""
    from hpkv.fsinfo import mem_available_bytes

    point = tmp_path / "ramfs"
    mount_tmpfs(point, "mode=0700", fs_type="ramfs")
    try:
        with caplog.at_level("WARNING", logger="hpkv.storage.tier"):
            tier = open_tier(root=point / "storage", capacity=None)
            assert tier.scan_done.wait(10)

        assert 0.3 * mem_available_bytes() < tier.capacity.capacity_bytes < 0.5 * mem_available_bytes()
        assert write(tier, key(1))
        assert list((point / "storage").rglob("*.kv")) == [Path(tier.paths.path_of(NS, key(1)))]
        said = [r.getMessage() for r in caplog.records if "memory file system" in r.getMessage()]
        assert len(said) == 1 and "ramfs" in said[0] and "lost at reboot" in said[0]
        assert "HPKV_KV_STORAGE_SIZE=auto gave" in said[0]
        assert not [r for r in caplog.records if "storage tier holds only" in r.getMessage()]
        tier.close()
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True)


def test_an_automatic_capacity_on_ramfs_leaves_out_the_pool_and_a_container_s_limit(
    open_tier, tmp_path, monkeypatch, caplog
):
    """The host says 64 GiB available, the container's cgroup leaves 24 GiB, and a 10 GiB pool on
    ramfs will take its pages later: auto is 80% of half of the 14 GiB left."""
    from helpers.machine import GIB, pretend

    point = tmp_path / "ram"
    pretend(
        monkeypatch, tmp_path, 64 * GIB, ramfs=(point,), cgroup="/ctr", limits={"/ctr": (str(32 * GIB), 8 * GIB, 0)}
    )

    with caplog.at_level("WARNING", logger="hpkv.storage.tier"):
        tier = StorageTier(make_storage_config(point / "storage", None))
        tier.start(promised_ram_bytes=10 * GIB)
    try:
        assert tier.scan_done.wait(10)
        assert tier.capacity.capacity_bytes == int(7 * GIB * 0.8)
        said = next(r.getMessage() for r in caplog.records if "memory file system" in r.getMessage())
        assert f"less the DRAM pool's {10 * GIB} bytes still to come" in said
    finally:
        tier.close()


def test_an_automatic_capacity_on_a_full_disk_says_so_and_writes_nothing(open_tier, small_disk, caplog):
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        with pytest.raises(OSError) as full:
            while True:
                f.write(b"\0" * (256 << 10))
    assert full.value.errno == errno.ENOSPC

    with caplog.at_level("WARNING", logger="hpkv.storage.tier"):
        tier = open_tier(root=small_disk / "kv", capacity=None)
        assert tier.scan_done.wait(10)

    assert tier.capacity.capacity_bytes == 0
    warning = next(r.getMessage() for r in caplog.records if "storage tier holds only" in r.getMessage())
    assert str(small_disk / "kv") in warning and "are not written" in warning
    assert "HPKV_KV_STORAGE_SIZE" in warning
    assert not write(tier, key(1))
    assert list((small_disk / "kv").rglob("*.kv")) == []


def test_an_automatic_capacity_counts_the_tiers_own_files_and_is_not_a_warning_then(
    open_tier, small_disk, caplog, monkeypatch
):
    """A disk full of HPKV's own files is not a full disk: its files count toward the capacity."""
    first = open_tier(root=small_disk, capacity=None)
    assert first.scan_done.wait(10)
    written = sum(write(first, key(i)) for i in range(8))
    assert written == 8
    monkeypatch.setattr(capacity_module, "SMALL_AUTO_CAPACITY", 4 * file_bytes())  # this disk's scale
    filler = small_disk / "filler"  # the rest of the disk, so that its own files are what the tier has
    with open(filler, "wb") as f:
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * (64 << 10))
    caplog.clear()

    with caplog.at_level("WARNING", logger="hpkv.storage.tier"):
        again = open_tier(root=small_disk, capacity=None)
        assert again.scan_done.wait(10)

    own = 0.8 * 8 * file_bytes()
    assert int(own) <= again.capacity.capacity_bytes < own + 0.8 * (64 << 10)  # the filler leaves under 64 KiB free
    assert not [r for r in caplog.records if "storage tier holds only" in r.getMessage()]


def test_the_automatic_capacity_is_a_share_of_the_room_and_of_hpkv_s_own_files():
    """The formula `hpkv doctor` shows is the one the tier sizes itself with."""
    share = AUTO_CAPACITY_FRACTION

    assert auto_capacity_bytes(10 << 30) == int((10 << 30) * share)
    assert auto_capacity_bytes(10 << 30, 5 << 30) == int((10 << 30) * share) + int((5 << 30) * share)
    assert auto_capacity_bytes(0) == 0 and little_room(0) and not little_room(auto_capacity_bytes(10 << 30))
