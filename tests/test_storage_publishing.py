"""Stories about publishing entry files (`storage/publishing.py`): the write budget, failed and short
writes, directories removed under the tier, writes reported failed after their rename, and the
fsync modes."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import socket
import threading

import pytest

from helpers import storage_stories as stories
from helpers.clock import FakeClock
from helpers.config import make_storage_config
from helpers.storage_stories import ENTRY, NS, FailingIO, file_bytes, key, payload, read, temps, write
from hpkv.storage import format as fmt
from hpkv.storage.fileio import FileIO, FileTarget, direct_supported, write_entry_file
from hpkv.storage.storage_tier import StorageTier

open_tier, tier = stories.open_tier, stories.tier


# -- the write budget -------------------------------------------------------------------------


def test_a_write_budget_refuses_writes_past_it_until_it_refills(storage_dir, caplog):
    """HPKV_KV_STORAGE_WRITE_BUDGET: the bucket holds an hour's worth and refills at the budget's
    rate; a write past it is not made (the entry stays in DRAM only), counted, and said once."""
    per_day = 3 * file_bytes() * 24  # an hour's worth: three files
    clock = FakeClock()
    tier = StorageTier(
        dataclasses.replace(make_storage_config(storage_dir, 64 * file_bytes()), write_budget_bytes=per_day),
        clock=clock,
    )
    tier.start()
    try:
        assert [write(tier, key(i)) for i in range(5)] == [True, True, True, False, False]
        stats = tier.stats()
        assert stats.over_budget == 2 and stats.write_failures == 0 and stats.writes == 3
        assert stats.write_budget_bytes == per_day and stats.write_budget_available_bytes < file_bytes()
        assert not os.path.exists(tier.paths.path_of(NS, key(3)))
        assert caplog.text.count("write budget (HPKV_KV_STORAGE_WRITE_BUDGET") == 1
        clock.advance(20 * 60)  # a file's worth more
        assert [write(tier, key(i)) for i in (3, 4)] == [True, False]
        assert read(tier, key(3)) == payload(key(3))  # reads are not counted
        assert tier.stats().over_budget == 3
    finally:
        tier.close()


def test_a_write_that_raises_gives_its_budget_back(storage_dir):
    """A writer that raises (no write-through process could start) wrote nothing: its bytes go
    back to the budget, so the caller's write in process is not charged twice."""
    from hpkv.storage.writer import WriterUnavailable

    tier = StorageTier(
        dataclasses.replace(
            make_storage_config(storage_dir, 64 * file_bytes()), write_budget_bytes=3 * file_bytes() * 24
        )
    )
    tier.start()

    def no_process(target):
        raise WriterUnavailable("no write-through process")

    try:
        before = tier.stats().write_budget_available_bytes
        with pytest.raises(WriterUnavailable):
            tier.publish(NS, key(1), ENTRY, fmt.VERSION, no_process)
        assert tier.stats().write_budget_available_bytes >= before
        assert [write(tier, key(i)) for i in range(4)] == [True, True, True, False]  # still three files
    finally:
        tier.close()


# -- failed writes ----------------------------------------------------------------------------


def test_an_io_error_on_write_is_a_dropped_write(open_tier, storage_dir):
    tier = open_tier(io=FailingIO(write_errno=errno.EIO))

    assert not write(tier, key(1))

    assert not tier.contains(NS, key(1))
    assert tier.stats().write_failures == 1
    assert tier.stats().used_bytes == 0
    assert temps(storage_dir) == []


def test_a_namespace_directory_removed_under_the_tier_is_made_again(tier, storage_dir):
    """The tier remembers the directories it made: one removed under it (`rm -rf` of the root or
    of a namespace) is made again, and the write is not lost."""
    assert write(tier, key(1))
    shutil.rmtree(storage_dir / NS)

    assert write(tier, key(1))

    assert read(tier, key(1)) == payload(key(1))
    assert tier.stats().write_failures == 0


def test_a_root_removed_and_made_again_under_the_tier_is_read_again(tier, storage_dir):
    """The tier holds its root open: after `rm -rf` of the root and a write that makes it again,
    reads and evictions go to the new root, not to the removed one it held."""
    assert write(tier, key(1))
    shutil.rmtree(storage_dir)

    assert write(tier, key(2))

    assert read(tier, key(2)) == payload(key(2))
    assert read(tier, key(1)) is None
    assert tier.remove(NS) == 1 and not list(storage_dir.rglob("*.kv"))


def test_a_write_reported_failed_after_its_rename_is_indexed(open_tier):
    """A writer process killed after its rename reports a failure: the file is in place, whole,
    and counted, not left out of the index."""
    tier = open_tier()
    k = key(1)
    header = fmt.encode_header(bytes.fromhex(NS), k, payload(k), fmt.VERSION)

    def killed_after_rename(target: FileTarget) -> OSError:
        assert write_entry_file(tier.paths.io, target, [header, payload(k)], "off") is None
        return OSError(errno.EIO, "the write-through process 1234 exited (-9)")

    assert tier.publish(NS, k, ENTRY, fmt.VERSION, killed_after_rename)

    assert tier.indexed(NS, k) and tier.stats().used_bytes == file_bytes()
    assert tier.stats().write_failures == 0
    assert read(tier, k) == payload(k)


def test_one_short_write_is_retried_and_the_file_is_whole(open_tier, storage_dir):
    tier = open_tier(io=FailingIO(short_writes=1))

    assert write(tier, key(1))

    assert read(tier, key(1)) == payload(key(1))
    assert temps(storage_dir) == []


def test_writes_that_always_stop_short_are_dropped_and_leave_nothing(open_tier, storage_dir):
    tier = open_tier(io=FailingIO(short_writes=-1))

    assert not write(tier, key(1))

    assert not os.path.exists(tier.paths.path_of(NS, key(1)))
    assert temps(storage_dir) == []
    assert tier.stats().write_failures == 1


# -- durability -------------------------------------------------------------------------------


class CountingIO(FileIO):
    """Real system calls, counting the ones that make data durable."""

    def __init__(self) -> None:
        self.num_datasyncs = 0
        self.num_dir_syncs = 0

    def fdatasync(self, fd):
        self.num_datasyncs += 1
        super().fdatasync(fd)

    def fsync_dir(self, dir_fd):
        self.num_dir_syncs += 1
        super().fsync_dir(dir_fd)


@pytest.mark.parametrize("fsync, datasyncs, dir_syncs", [("off", 0, 0), ("data", 2, 0), ("full", 2, 2)])
def test_fsync_modes_sync_what_they_promise(open_tier, fsync, datasyncs, dir_syncs):
    io = CountingIO()
    tier = open_tier(io=io, fsync=fsync)

    assert write(tier, key(1)) and write(tier, key(2))

    assert (io.num_datasyncs, io.num_dir_syncs) == (datasyncs, dir_syncs)
    assert read(tier, key(1)) == payload(key(1))


class FailingDirSync(FileIO):
    def fsync_dir(self, dir_fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_a_directory_sync_failing_after_the_rename_leaves_the_file_published(storage_dir, caplog):
    """HPKV_KV_STORAGE_FSYNC=full: the file is whole and in place once renamed; a directory fsync
    failing after that is said (at most every ten minutes), and the write has succeeded."""
    import hpkv.storage.fileio as fileio

    fileio._dir_sync_warned_at = -float("inf")
    written = []
    for i in range(2):
        target = FileTarget(str(storage_dir / f"{i}.kv"), str(storage_dir / f".{i}.tmp"), str(storage_dir), False)
        written.append(write_entry_file(FailingDirSync(), target, [b"header", b"payload"], "full"))

    assert written == [None, None]
    assert (storage_dir / "0.kv").read_bytes() == (storage_dir / "1.kv").read_bytes() == b"headerpayload"
    assert temps(storage_dir) == []
    said = [r.getMessage() for r in caplog.records if "cannot fsync the directory" in r.getMessage()]
    assert len(said) == 1 and str(storage_dir) in said[0]


def test_direct_io_probes_survive_another_node_sweeping_their_files_away(storage_dir):
    """Nodes sharing a directory probe it at once: a probe whose file someone else removed is not
    an error out of the server's start."""
    stop = threading.Event()
    swept = []

    def other_node() -> None:
        while not stop.is_set():
            for path in storage_dir.glob(".direct-probe.*"):
                try:
                    path.unlink()
                    swept.append(path.name)
                except FileNotFoundError:
                    pass

    sweeper = threading.Thread(target=other_node)
    sweeper.start()
    try:
        results = {direct_supported(str(storage_dir)) for _ in range(500)}
    finally:
        stop.set()
        sweeper.join()

    if results == {False}:
        pytest.skip(f"{storage_dir} does not take O_DIRECT")
    assert swept, "the sweeper never met a probe file"
    assert socket.gethostname().replace(".", "_") in swept[0]
    assert list(storage_dir.glob(".direct-probe.*")) == []
