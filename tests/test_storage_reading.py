"""Stories about reading entry files (`storage/reading.py`): a damaged or foreign file is a miss and
goes, a read that fails or ends short is a miss that leaves the file, files this tier may not
read stop being hits (for good, or for a while after a device error)."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from helpers import storage_stories as stories
from helpers.clock import FakeClock
from helpers.storage_stories import (
    ENTRY,
    NS,
    OTHER_NS,
    FailingIO,
    RefusedOpens,
    file_bytes,
    key,
    payload,
    read,
    write,
)
from hpkv.storage import format as fmt
from hpkv.storage.fileio import FileIO
from hpkv.storage.reading import UNREADABLE_EIO_S, WARN_EVERY_S
from hpkv.storage.storage_tier import StorageTier

open_tier, tier = stories.open_tier, stories.tier


# -- bad files become misses and go away ------------------------------------------------------


def flip_payload_bit(path: Path, storage_dir: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(data)


def flip_header_bit(path: Path, storage_dir: Path) -> None:
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # inside the namespace digest
    path.write_bytes(data)


def truncate(path: Path, storage_dir: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def extend(path: Path, storage_dir: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 8)


def random_bytes(path: Path, storage_dir: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def another_namespace(path: Path, storage_dir: Path) -> None:
    # The same key's file from the other namespace: a valid file, just not ours.
    other = storage_dir / OTHER_NS / path.relative_to(storage_dir / NS)
    path.write_bytes(other.read_bytes())


def another_key(path: Path, storage_dir: Path) -> None:
    name = key(2).hex()
    path.write_bytes((storage_dir / NS / name[0:2] / name[2:4] / f"{name}.kv").read_bytes())


@pytest.mark.parametrize(
    "damage", [flip_payload_bit, flip_header_bit, truncate, extend, random_bytes, another_namespace, another_key]
)
def test_a_damaged_or_foreign_file_is_a_miss_and_is_removed(tier, storage_dir, damage):
    k = key(1)
    write(tier, k)
    write(tier, key(2))
    tier.write_from(OTHER_NS, k, memoryview(b"x" * ENTRY))  # same size, other bytes
    path = Path(tier.paths.path_of(NS, k))
    damage(path, storage_dir)
    entries_before = tier.stats().num_entries

    assert read(tier, k) is None

    assert not path.exists()
    assert not tier.contains(NS, k)
    assert tier.stats().bad_files == 1
    assert tier.stats().num_entries == entries_before - 1
    assert read(tier, key(2)) == payload(key(2))  # its neighbour is fine


def test_a_removed_bad_file_frees_its_capacity(tier):
    k = key(1)
    write(tier, k)
    used = tier.stats().used_bytes
    random_bytes(Path(tier.paths.path_of(NS, k)), tier.root)

    read(tier, k)

    assert tier.stats().used_bytes == used - file_bytes(k)


def test_a_read_with_the_wrong_entry_size_is_a_miss(tier):
    k = key(1)
    write(tier, k)

    assert read(tier, k, size=ENTRY - 8) is None
    assert tier.stats().bad_files == 1


def test_reading_an_old_file_refreshes_its_age_on_disk(tier):
    k = key(1)
    write(tier, k)
    path = tier.paths.path_of(NS, k)
    old = time.time() - 3600
    os.utime(path, (old, old))

    read(tier, k)

    assert os.stat(path).st_mtime > time.time() - 60


# -- reads that fail --------------------------------------------------------------------------


def test_an_io_error_on_read_is_a_miss(open_tier, storage_dir):
    io = FailingIO()
    tier = open_tier(io=io)
    write(tier, key(1))
    io.read_errno = errno.EIO

    assert read(tier, key(1)) is None
    assert os.path.exists(tier.paths.path_of(NS, key(1)))  # the medium failed, not the file: kept
    io.read_errno = None
    assert read(tier, key(1)) == payload(key(1))


class ShortReads(FileIO):
    """Real reads that return at most `most` bytes each, as a signal or a network file system's
    transfer size may; with `ended`, nothing after the first (a file cut short under the reader)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.ended = False

    def preadv(self, fd, buffers, offset):
        if self.ended and offset > 0:
            return 0
        with memoryview(buffers[0]) as first, first[: self.most] as part:
            return os.preadv(fd, [part], offset)


def test_reads_that_return_short_go_on_to_the_whole_file(open_tier):
    tier = open_tier(io=ShortReads(4096))
    write(tier, key(1))

    assert read(tier, key(1)) == payload(key(1))
    assert tier.stats().bad_files == 0 and tier.stats().reads == 1


def test_a_read_that_ends_short_is_a_miss_and_keeps_the_file(open_tier, caplog):
    """Only a file read whole that fails its checks is deleted."""
    io = ShortReads(4096)
    tier = open_tier(io=io)
    write(tier, key(1))
    io.ended = True

    assert read(tier, key(1)) is None and read(tier, key(1)) is None

    assert os.path.exists(tier.paths.path_of(NS, key(1))) and tier.indexed(NS, key(1))
    assert tier.stats().bad_files == 0 and tier.stats().read_misses == 2
    assert caplog.text.count("cannot read KV files") == 1
    io.ended = False
    assert read(tier, key(1)) == payload(key(1))


def test_read_errors_are_said_again_after_a_while_not_once_for_good(open_tier, caplog):
    """A device that fails, recovers, and fails again hours later is said again: one kind of
    error at most every WARN_EVERY_S, counted always."""
    io, clock = ShortReads(4096), FakeClock()
    tier = open_tier(io=io, clock=clock)
    write(tier, key(1))
    io.ended = True

    assert read(tier, key(1)) is None and read(tier, key(1)) is None
    assert caplog.text.count("cannot read KV files") == 1
    clock.advance(WARN_EVERY_S - 1)
    assert read(tier, key(1)) is None and caplog.text.count("cannot read KV files") == 1
    clock.advance(1)
    assert read(tier, key(1)) is None

    assert caplog.text.count("cannot read KV files") == 2
    assert tier.stats().read_misses == 4


@pytest.mark.parametrize("refusal", [errno.EACCES, errno.EPERM, errno.ENAMETOOLONG])
def test_a_file_this_tier_may_not_open_is_no_longer_a_hit(open_tier, caplog, refusal):
    """Left in the index, every lookup was a hit that every promotion missed, each with a
    warning. Forgotten, not adopted again by a lookup's stat, said once; written again, it is a
    hit again."""
    io = RefusedOpens()
    tier = open_tier(io=io)
    write(tier, key(1))
    write(tier, key(2))
    io.errno = refusal

    assert [read(tier, key(i)) for i in (1, 2, 1)] == [None, None, None]

    assert not tier.indexed(NS, key(1)) and not tier.contains(NS, key(1)) and not tier.contains(NS, key(2))
    assert os.path.exists(tier.paths.path_of(NS, key(1)))  # not this tier's to delete
    assert tier.stats().used_bytes == 0 and tier.stats().bad_files == 0
    assert caplog.text.count("cannot read KV files") == 1
    io.errno = 0
    assert write(tier, key(1)) and tier.contains(NS, key(1))
    assert read(tier, key(1)) == payload(key(1))


def test_a_failed_rewrite_does_not_adopt_the_file_this_tier_could_not_read(open_tier):
    """The file in place after a failed write is the one this tier was refused before: indexed,
    every lookup would count it as a hit that every promotion misses."""
    io = RefusedOpens()
    tier = open_tier(io=io)
    write(tier, key(1))
    io.errno = errno.EACCES
    assert read(tier, key(1)) is None
    io.errno = 0

    assert not tier.publish(NS, key(1), ENTRY, fmt.VERSION, lambda target: OSError(errno.EIO, "injected"))

    assert not tier.indexed(NS, key(1)) and not tier.contains(NS, key(1))
    assert tier.stats().write_failures == 1


def two_files_the_device_fails_to_read(open_tier, clock: FakeClock | None = None) -> tuple[StorageTier, FailingIO]:
    """Keys 1 and 2 written, then read while the device fails (EIO); the device still fails."""
    io = FailingIO()
    tier = open_tier(io=io, clock=clock)
    write(tier, key(1))
    write(tier, key(2))
    io.read_errno = errno.EIO
    assert read(tier, key(1)) is None and read(tier, key(2)) is None
    return tier, io


def test_a_file_its_device_fails_to_read_is_forgotten_and_found_again_by_a_scan(open_tier, caplog):
    tier, io = two_files_the_device_fails_to_read(open_tier)

    assert not tier.contains(NS, key(1)) and not tier.contains(NS, key(2))
    assert caplog.text.count("cannot read KV files") == 1
    io.read_errno = 0
    again = open_tier()
    assert again.scan_done.wait(10) and again.indexed(NS, key(1))
    assert read(again, key(1)) == payload(key(1))


def test_a_device_error_passes_and_the_file_is_found_again(open_tier):
    """EIO often passes (a Lustre client evicted, an NFS soft timeout): the file is a miss for a
    while, then a lookup adopts it again and its bytes count again; a read that succeeds
    meanwhile ends the while at once."""
    clock = FakeClock()
    tier, io = two_files_the_device_fails_to_read(open_tier, clock)
    assert not tier.contains(NS, key(1)) and tier.stats().used_bytes == 0
    io.read_errno = 0

    assert read(tier, key(2)) == payload(key(2))  # a promotion queued before the error, say
    assert tier.contains(NS, key(2)) and not tier.contains(NS, key(1))
    clock.advance(UNREADABLE_EIO_S - 1)
    assert not tier.contains(NS, key(1))
    clock.advance(1)
    assert tier.contains(NS, key(1))

    assert tier.stats().used_bytes == 2 * file_bytes() and tier.stats().num_entries == 2
    assert read(tier, key(1)) == payload(key(1))
