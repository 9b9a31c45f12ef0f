"""Stories about a storage root other nodes share, on this machine's own file systems (the real
network file systems are in test_netfs_two_nodes.py): stale handles are retries or misses, never
exceptions, and walks of the root (`storage/rescan.py`) teach each tier the others' files, so
tiers sharing a directory hold at most its capacity together."""

from __future__ import annotations

import errno
import functools
import os

from helpers import storage_stories as stories
from helpers.storage_stories import NS, file_bytes, key, payload, read, write
from hpkv.fsinfo import Mount
from hpkv.storage import rescan
from hpkv.storage.eviction import SLACK_MINUTES
from hpkv.storage.fileio import FileIO
from hpkv.storage.index import used_minute_s
from hpkv.storage.storage_tier import StorageTier

open_tier, tier = stories.open_tier, stories.tier


class StaleHandles(FileIO):
    """Real system calls; the next `stale_reads` reads and `stale_closes` closes of entry files
    opened for reading fail with ESTALE, as on GlusterFS when another node replaces the file."""

    def __init__(self, stale_reads: int = 0, stale_closes: int = 0) -> None:
        self.stale_reads = stale_reads
        self.stale_closes = stale_closes

    def preadv(self, fd, buffers, offset):
        if self.stale_reads:
            self.stale_reads -= 1
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return super().preadv(fd, buffers, offset)

    def close(self, fd):
        super().close(fd)  # closed all the same, as Linux does whatever close returns
        if self.stale_closes:
            self.stale_closes -= 1
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))


def test_a_stale_handle_on_close_after_a_good_read_is_a_hit(open_tier):
    io = StaleHandles()
    tier = open_tier(io=io)
    write(tier, key(1))
    io.stale_closes = 1

    assert read(tier, key(1)) == payload(key(1))
    assert io.stale_closes == 0
    assert tier.stats().reads == 1 and tier.stats().read_misses == 0


def test_a_stale_handle_on_read_is_read_again_by_name_once(open_tier):
    io = StaleHandles()
    tier = open_tier(io=io)
    write(tier, key(1))

    io.stale_reads = 1
    assert read(tier, key(1)) == payload(key(1))  # the file replaced meanwhile: its new version
    io.stale_reads = 2
    assert read(tier, key(1)) is None  # stale again: a miss, the file left for the next lookup
    assert tier.contains(NS, key(1)) and read(tier, key(1)) == payload(key(1))


def test_a_walk_indexes_what_another_tier_wrote_and_forgets_what_it_removed(open_tier, storage_dir):
    a, b = open_tier(), open_tier()
    assert a.scan_done.wait(10) and b.scan_done.wait(10)
    for i in range(4):
        write(a, key(i))
    write(b, key(9))
    os.unlink(b.paths.path_of(NS, key(9)))  # as if another node evicted it

    assert b.rescan.once() == (4, 1)
    assert all(b.indexed(NS, key(i)) for i in range(4)) and not b.indexed(NS, key(9))
    assert b.evictor.shared and b.index.used_bytes == 4 * file_bytes()


def test_a_walk_dates_what_it_finds_by_the_tiers_wall_clock(open_tier, storage_dir):
    """Files a walk learns are known as used SLACK_MINUTES before the walk, on the tier's clock."""
    then = 1_000_000 * 60.0  # a minute long past
    a = open_tier()
    b = open_tier(cls=functools.partial(StorageTier, wall_clock=lambda: then))
    assert a.scan_done.wait(10) and b.scan_done.wait(10)
    write(a, key(1))

    assert b.rescan.once() == (1, 0)
    [(ik, value)] = b.index.items()
    assert b.index.split(ik) == (NS, key(1))
    assert used_minute_s(value) == then - SLACK_MINUTES * 60


def test_tiers_sharing_a_directory_stay_within_its_capacity_together(open_tier, storage_dir):
    a, b = open_tier(capacity=8 * file_bytes()), open_tier(capacity=8 * file_bytes())
    assert a.scan_done.wait(10) and b.scan_done.wait(10)

    for i in range(0, 24, 4):
        for j in range(i, i + 4):
            write(a, key(f"a{j}")), write(b, key(f"b{j}"))
        a.rescan.once(), b.rescan.once()

    assert len(list(storage_dir.rglob("*.kv"))) <= 8


def test_network_and_parallel_file_systems_count_as_shared():
    assert rescan.on_shared_fs(Mount("/mnt/g", "fuse.glusterfs", "host:/vol"))
    assert rescan.on_shared_fs(Mount("/mnt/m", "fuse", "mfs\\04310.0.0.1:9421"))  # MooseFS, as mountinfo says it
    assert rescan.on_shared_fs(Mount("/mnt/l", "lustre", "10.0.0.1@tcp:/fs"))
    assert not rescan.on_shared_fs(Mount("/", "ext4", "/dev/vda1"))
    assert not rescan.on_shared_fs(Mount("/mnt/s", "fuse", "sshfs#x"))
