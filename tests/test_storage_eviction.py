"""Stories about eviction (`storage/eviction.py`): a bounded tier evicts LRU, and spares the files
other nodes read since, without a lookup ever adopting a victim on its way out."""

from __future__ import annotations

import errno
import os

import pytest

from helpers import storage_stories as stories
from helpers.storage_stories import (
    NS,
    OTHER_NS,
    CountedStats,
    HookedUnlinks,
    RefusedAndCounted,
    age,
    file_bytes,
    key,
    payload,
    read,
    see_sharing,
    write,
)
from hpkv.storage.fileio import FileIO
from hpkv.storage.storage_tier import StorageTier

open_tier = stories.open_tier


def test_capacity_for_four_write_five_the_first_is_gone_from_disk(open_tier):
    tier = open_tier(capacity=4 * file_bytes())
    for i in range(5):
        assert write(tier, key(i))

    assert not os.path.exists(tier.paths.path_of(NS, key(0)))
    assert not tier.contains(NS, key(0))
    assert all(read(tier, key(i)) == payload(key(i)) for i in range(1, 5))
    assert tier.stats().evictions == 1
    assert tier.stats().used_bytes == 4 * file_bytes()


def test_an_eviction_that_fails_midway_leaves_its_victims_indexed_and_counted(open_tier):
    """Something other than an OSError out of an unlink (a bug, a MemoryError): the victims not
    yet removed stay hits, counted in what the tier holds, and not misses for good."""

    class BrokenUnlink(FileIO):
        def unlink(self, path, dir_fd=None):
            raise RuntimeError("unlink broke")

    tier = open_tier(capacity=4 * file_bytes(), io=BrokenUnlink())
    for i in range(4):
        assert write(tier, key(i))
    with pytest.raises(RuntimeError):
        write(tier, key(4))

    assert os.path.exists(tier.paths.path_of(NS, key(0)))
    assert tier.indexed(NS, key(0)) and tier.contains(NS, key(0))
    assert read(tier, key(0)) == payload(key(0))
    assert tier.stats().used_bytes == 4 * file_bytes()


def test_a_read_makes_an_entry_the_most_recently_used(open_tier):
    tier = open_tier(capacity=4 * file_bytes())
    for i in range(4):
        write(tier, key(i))

    read(tier, key(0))
    write(tier, key(4))

    assert os.path.exists(tier.paths.path_of(NS, key(0)))
    assert not os.path.exists(tier.paths.path_of(NS, key(1)))


def test_eviction_spares_a_file_another_node_read_since(open_tier):
    """Reads refresh a file's mtime, on every node: where another node shares the directory,
    the oldest file in this node's index that it has read since is not evicted, but goes to
    the recent end; the next one goes."""
    first = open_tier()
    for i in range(3):
        write(first, key(i))
    age(first, {0: 3 * 3600, 1: 2 * 3600, 2: 3600})  # key 0 used longest ago, then key 1
    tier, other = open_tier(capacity=3 * file_bytes()), open_tier()
    assert tier.scan_done.wait(10) and other.scan_done.wait(10)
    see_sharing(tier, other)
    assert read(other, key(0)) == payload(key(0))  # another node uses key 0 now

    assert write(tier, key(3))

    assert os.path.exists(tier.paths.path_of(NS, key(0))) and tier.indexed(NS, key(0))
    assert not os.path.exists(tier.paths.path_of(NS, key(1))) and not tier.indexed(NS, key(1))
    assert tier.stats().evictions == 1 and tier.stats().used_bytes == 3 * file_bytes()
    assert write(tier, key(4))  # key 0 is the most recent now, but for key 3: key 2 goes
    assert not os.path.exists(tier.paths.path_of(NS, key(2))) and os.path.exists(tier.paths.path_of(NS, key(0)))


def test_a_tier_alone_in_its_directory_evicts_without_looking_at_its_victims(open_tier):
    """Looking at a victim is a `stat` on the write path (a round trip on Lustre): only worth it
    once this tier has seen another write here."""
    io = CountedStats()
    tier = open_tier(capacity=4 * file_bytes(), io=io)
    assert tier.scan_done.wait(10)

    assert all(write(tier, key(i)) for i in range(8))
    assert tier.stats().evictions == 4 and io.stats == 0

    see_sharing(tier, open_tier())
    io.stats = 0
    assert all(write(tier, key(i)) for i in range(8, 10))
    assert tier.stats().evictions == 6 and io.stats == 2


def test_a_victim_a_lookup_asks_for_before_its_unlink_is_a_miss(open_tier):
    """Between an eviction taking a victim out of the index and unlinking its file, a lookup's
    `stat` still finds the file: adopted, the index would hold a hit with no file."""
    io = CountedStats()
    tier = open_tier(capacity=3 * file_bytes(), io=io)
    assert tier.scan_done.wait(10)
    see_sharing(tier, open_tier())
    assert all(write(tier, key(i)) for i in range(3))
    age(tier, {0: 3600})
    found = []
    io.on_stat = lambda path: found.append(tier.contains(NS, key(0)))  # while the eviction looks at key 0

    assert write(tier, key(3))

    assert found == [False]
    assert not tier.indexed(NS, key(0)) and not os.path.exists(tier.paths.path_of(NS, key(0)))
    assert tier.stats().used_bytes == 3 * file_bytes() and tier.stats().evictions == 1


def test_a_lookup_of_a_victim_on_a_tier_alone_neither_adopts_it_nor_thinks_it_shared(open_tier):
    """A tier alone in its directory: its victim's file, still there for a moment, is its own,
    not another node's (which would make every later eviction `stat` its victims)."""
    io = HookedUnlinks()
    tier = open_tier(capacity=3 * file_bytes(), io=io)
    assert tier.scan_done.wait(10)
    assert all(write(tier, key(i)) for i in range(3))
    found = []
    io.on_unlink = lambda path: found.append(tier.contains(NS, key(0)))

    assert write(tier, key(3))

    assert found == [False] and not tier.evictor.shared
    assert not tier.indexed(NS, key(0)) and tier.stats().used_bytes == 3 * file_bytes()


def test_an_eviction_ends_when_every_file_was_read_elsewhere(open_tier):
    """Each victim is looked at once per eviction: when all were read by other nodes, the oldest
    goes after all."""
    first = open_tier()
    for i in range(3):
        write(first, key(i))
    age(first, {0: 3 * 3600, 1: 2 * 3600, 2: 3600})
    tier, other = open_tier(capacity=3 * file_bytes()), open_tier()
    assert tier.scan_done.wait(10) and other.scan_done.wait(10)
    see_sharing(tier, other)
    assert [read(other, key(i)) for i in range(3)] == [payload(key(i)) for i in range(3)]

    assert write(tier, key(3))

    assert [os.path.exists(tier.paths.path_of(NS, key(i))) for i in range(4)] == [False, True, True, True]
    assert tier.stats().evictions == 1 and tier.stats().used_bytes == 3 * file_bytes()


def spare_key_0(open_tier, io: FileIO) -> StorageTier:
    """A tier of three files (found at start), sharing its directory, whose key 0 another node
    read since."""
    first = open_tier()
    assert all(write(first, key(i)) for i in range(3))
    age(first, {0: 3 * 3600, 1: 2 * 3600, 2: 3600})
    tier, other = open_tier(capacity=3 * file_bytes(), io=io), open_tier()
    assert tier.scan_done.wait(10) and other.scan_done.wait(10)
    see_sharing(tier, other)
    assert read(other, key(0)) == payload(key(0))
    return tier


def test_a_victim_spared_while_a_remove_runs_does_not_come_back(open_tier):
    """An eviction spares key 0 (read elsewhere) while a `clear` of storage removes every file:
    put back in the index, it would be a hit with no file."""
    io = CountedStats()
    tier = spare_key_0(open_tier, io)
    io.on_stat = lambda path: tier.remove()  # while the eviction looks at key 0

    assert write(tier, key(3))

    assert [tier.indexed(NS, key(i)) for i in range(4)] == [
        os.path.exists(tier.paths.path_of(NS, key(i))) for i in range(4)
    ]
    assert not tier.indexed(NS, key(0)) and tier.stats().used_bytes == file_bytes()


def test_a_victim_spared_while_another_namespace_is_removed_comes_back(open_tier):
    io = CountedStats()
    tier = spare_key_0(open_tier, io)
    io.on_stat = lambda path: tier.remove(OTHER_NS)  # while the eviction looks at key 0

    assert write(tier, key(3))

    assert tier.indexed(NS, key(0)) and os.path.exists(tier.paths.path_of(NS, key(0)))
    assert [os.path.exists(tier.paths.path_of(NS, key(i))) for i in range(1, 4)] == [False, True, True]
    assert tier.stats().used_bytes == 3 * file_bytes() and tier.stats().evictions == 1


def test_a_victim_spared_while_it_is_found_unreadable_does_not_come_back(open_tier):
    io = RefusedAndCounted()
    tier = spare_key_0(open_tier, io)

    def refused_meanwhile(path: str) -> None:
        io.errno = errno.EACCES
        assert read(tier, key(0)) is None
        io.errno = 0

    io.on_stat = refused_meanwhile

    assert write(tier, key(3))

    assert not tier.indexed(NS, key(0)) and not tier.contains(NS, key(0))
    assert tier.stats().used_bytes == 3 * file_bytes()  # keys 1 (or 2), 3 and the one left
