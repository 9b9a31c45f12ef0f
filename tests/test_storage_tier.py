"""Stories about the storage tier: checksummed files that read back or become misses, a bounded
capacity evicted LRU, restarts, temporaries of dead writers, several tiers on one root, a full disk
and injected I/O faults."""

from __future__ import annotations

import errno
import math
import hashlib
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from helpers.config import make_storage_config
from hpkv.errors import StorageError
from hpkv.keys import make_key
from hpkv.storage import format as fmt
from hpkv.storage.fileio import FileIO, FileTarget, direct_supported, write_entry_file
from hpkv.storage.root import StorageUnusable
from hpkv.storage.scan import STALE_TEMP_S
from hpkv.storage.tier import StorageTier

NS = "0123456789abcdef" * 2
OTHER_NS = "fedcba9876543210" * 2
ENTRY = 16 << 10


def key(i: int | str) -> bytes:
    return make_key(hashlib.sha256(f"key-{i}".encode()).digest())


def payload(k: bytes, size: int = ENTRY) -> bytes:
    block = hashlib.blake2b(k).digest()
    return (block * (size // len(block) + 1))[:size]


def file_bytes(k: bytes = key(0), size: int = ENTRY) -> int:
    """What one entry takes on disk (and in the tier's capacity)."""
    return fmt.header_bytes(len(k)) + size


def write(tier: StorageTier, k: bytes, ns: str = NS, size: int = ENTRY) -> bool:
    return tier.write_from(ns, k, memoryview(payload(k, size)))


def read(tier: StorageTier, k: bytes, ns: str = NS, size: int = ENTRY) -> bytes | None:
    dest = bytearray(size)
    return bytes(dest) if tier.read_into(ns, k, memoryview(dest)) else None


def temps(root: Path) -> list[Path]:
    return sorted(root.rglob("*.tmp"))


def eventually(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def open_tier(storage_dir):
    tiers = []

    def _open(root: Path = storage_dir, capacity: int | None = 64 * file_bytes(), io: FileIO | None = None,
              fsync: str = "off", cls=StorageTier) -> StorageTier:
        tier = cls(make_storage_config(root, capacity, fsync), io)
        tiers.append(tier)
        tier.start()
        for ns in (NS, OTHER_NS):
            tier.add_namespace(ns, '{"test": true}')
        return tier

    yield _open
    for tier in tiers:
        tier.close()


@pytest.fixture
def tier(open_tier):
    tier = open_tier()
    assert tier.scan_done.wait(10)
    return tier


def mount_tmpfs(point: Path, options: str, fs_type: str = "tmpfs") -> None:
    point.mkdir(exist_ok=True)
    result = subprocess.run(["mount", "-t", fs_type, "-o", options, fs_type, str(point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a {fs_type} (needs root): {result.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MiB file system to fill up."""
    point = tmp_path / "disk-4m"
    mount_tmpfs(point, "size=4m")
    yield point
    subprocess.run(["umount", "-l", str(point)], check=True)


# -- files ---------------------------------------------------------------------------------------

def test_a_write_budget_refuses_writes_past_it_until_it_refills(storage_dir, caplog):
    """HPKV_KV_STORAGE_WRITE_BUDGET: the bucket holds an hour's worth and refills at the budget's
    rate; a write past it is not made (the entry stays in DRAM only), counted, and said once."""
    import dataclasses

    per_day = 3 * file_bytes() * 24  # an hour's worth: three files
    tier = StorageTier(dataclasses.replace(make_storage_config(storage_dir, 64 * file_bytes()),
                                           write_budget_bytes=per_day))
    tier.start()
    try:
        assert [write(tier, key(i)) for i in range(5)] == [True, True, True, False, False]
        stats = tier.stats()
        assert stats["over_budget"] == 2 and stats["write_failures"] == 0 and stats["writes"] == 3
        assert stats["write_budget_bytes"] == per_day and stats["write_budget_available_bytes"] < file_bytes()
        assert not os.path.exists(tier.path_of(NS, key(3)))
        assert caplog.text.count("write budget (HPKV_KV_STORAGE_WRITE_BUDGET") == 1
        tier.budget._at -= 20 * 60  # as if 20 minutes had passed: a file's worth more
        assert [write(tier, key(i)) for i in (3, 4)] == [True, False]
        assert read(tier, key(3)) == payload(key(3))  # reads are not counted
        assert tier.stats()["over_budget"] == 3
    finally:
        tier.close()


def test_a_write_that_raises_gives_its_budget_back(storage_dir):
    """A writer that raises (no write-through process could start) wrote nothing: its bytes go
    back to the budget, so the caller's write in process is not charged twice."""
    import dataclasses

    from hpkv.storage.writer import WriterUnavailable

    tier = StorageTier(dataclasses.replace(make_storage_config(storage_dir, 64 * file_bytes()),
                                           write_budget_bytes=3 * file_bytes() * 24))
    tier.start()

    def no_process(target):
        raise WriterUnavailable("no write-through process")

    try:
        before = tier.stats()["write_budget_available_bytes"]
        with pytest.raises(WriterUnavailable):
            tier.publish(NS, key(1), ENTRY, fmt.VERSION, no_process)
        assert tier.stats()["write_budget_available_bytes"] >= before
        assert [write(tier, key(i)) for i in range(4)] == [True, True, True, False]  # still three files
    finally:
        tier.close()


def test_an_entry_written_reads_back_identical(tier):
    k = key(1)

    assert write(tier, k)

    assert tier.contains(NS, k)
    assert read(tier, k) == payload(k)
    assert tier.stats()["reads"] == 1 and tier.stats()["writes"] == 1


def test_an_entry_lives_in_its_fanned_out_file_and_leaves_no_temporary(tier, storage_dir):
    k = key(1)
    write(tier, k)

    name = k.hex()
    path = storage_dir / NS / name[0:2] / name[2:4] / f"{name}.kv"
    assert tier.path_of(NS, k) == str(path)
    assert path.stat().st_size == file_bytes(k)
    assert temps(storage_dir) == []


def test_a_key_never_written_is_a_miss(tier):
    assert not tier.contains(NS, key(1))
    assert read(tier, key(1)) is None
    assert tier.stats()["read_misses"] == 1


def test_the_same_key_in_two_namespaces_is_two_entries(tier):
    k = key(1)
    tier.write_from(NS, k, memoryview(b"a" * ENTRY))
    tier.write_from(OTHER_NS, k, memoryview(b"b" * ENTRY))

    assert read(tier, k, NS) == b"a" * ENTRY
    assert read(tier, k, OTHER_NS) == b"b" * ENTRY


def test_the_namespace_description_is_kept_beside_the_data(tier, storage_dir):
    assert (storage_dir / NS / "namespace.json").read_text() == '{"test": true}\n'


# -- bad files become misses and go away ---------------------------------------------------------

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


@pytest.mark.parametrize("damage", [flip_payload_bit, flip_header_bit, truncate, extend, random_bytes,
                                    another_namespace, another_key])
def test_a_damaged_or_foreign_file_is_a_miss_and_is_removed(tier, storage_dir, damage):
    k = key(1)
    write(tier, k)
    write(tier, key(2))
    tier.write_from(OTHER_NS, k, memoryview(b"x" * ENTRY))  # same size, other bytes
    path = Path(tier.path_of(NS, k))
    damage(path, storage_dir)
    entries_before = tier.stats()["num_entries"]

    assert read(tier, k) is None

    assert not path.exists()
    assert not tier.contains(NS, k)
    assert tier.stats()["bad_files"] == 1
    assert tier.stats()["num_entries"] == entries_before - 1
    assert read(tier, key(2)) == payload(key(2))  # its neighbour is fine


def test_a_removed_bad_file_frees_its_capacity(tier):
    k = key(1)
    write(tier, k)
    used = tier.stats()["used_bytes"]
    random_bytes(Path(tier.path_of(NS, k)), tier.root)

    read(tier, k)

    assert tier.stats()["used_bytes"] == used - file_bytes(k)


def test_a_read_with_the_wrong_entry_size_is_a_miss(tier):
    k = key(1)
    write(tier, k)

    assert read(tier, k, size=ENTRY - 8) is None
    assert tier.stats()["bad_files"] == 1


# -- capacity and LRU ----------------------------------------------------------------------------

def test_capacity_for_four_write_five_the_first_is_gone_from_disk(open_tier):
    tier = open_tier(capacity=4 * file_bytes())
    for i in range(5):
        assert write(tier, key(i))

    assert not os.path.exists(tier.path_of(NS, key(0)))
    assert not tier.contains(NS, key(0))
    assert all(read(tier, key(i)) == payload(key(i)) for i in range(1, 5))
    assert tier.stats()["evictions"] == 1
    assert tier.stats()["used_bytes"] == 4 * file_bytes()


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

    assert os.path.exists(tier.path_of(NS, key(0)))
    assert tier.indexed(NS, key(0)) and tier.contains(NS, key(0))
    assert read(tier, key(0)) == payload(key(0))
    assert tier.stats()["used_bytes"] == 4 * file_bytes()


def test_a_read_makes_an_entry_the_most_recently_used(open_tier):
    tier = open_tier(capacity=4 * file_bytes())
    for i in range(4):
        write(tier, key(i))

    read(tier, key(0))
    write(tier, key(4))

    assert os.path.exists(tier.path_of(NS, key(0)))
    assert not os.path.exists(tier.path_of(NS, key(1)))


def test_an_entry_larger_than_the_capacity_is_not_written(open_tier):
    tier = open_tier(capacity=file_bytes() - 1)

    assert not write(tier, key(1))

    assert not os.path.exists(tier.path_of(NS, key(1)))
    assert tier.stats()["write_failures"] == 1
    assert tier.stats()["evictions"] == 0


def test_rewriting_an_entry_does_not_count_it_twice(open_tier):
    tier = open_tier(capacity=4 * file_bytes())
    write(tier, key(1))

    write(tier, key(1))

    assert tier.stats()["num_entries"] == 1
    assert tier.stats()["used_bytes"] == file_bytes()


# -- restart -------------------------------------------------------------------------------------

def test_a_restarted_tier_finds_its_entries_again(open_tier, storage_dir):
    first = open_tier()
    for i in range(3):
        write(first, key(i))
    first.close()

    again = open_tier()
    assert again.scan_done.wait(10)

    assert again.stats()["files_scanned"] == 3
    assert again.stats()["num_entries"] == 3
    assert again.stats()["used_bytes"] == 3 * file_bytes()
    assert all(read(again, key(i)) == payload(key(i)) for i in range(3))


def test_after_a_restart_the_file_used_longest_ago_is_evicted_first(open_tier):
    first = open_tier()
    for i in range(3):
        write(first, key(i))
    first.close()
    now = time.time()
    for i, age_s in ((0, 100), (1, 300), (2, 200)):  # key 1 was used longest ago, then key 2
        os.utime(first.path_of(NS, key(i)), (now - age_s, now - age_s))

    again = open_tier(capacity=3 * file_bytes())
    assert again.scan_done.wait(10)
    write(again, key(3))
    assert not os.path.exists(again.path_of(NS, key(1)))
    write(again, key(4))
    assert not os.path.exists(again.path_of(NS, key(2)))
    assert os.path.exists(again.path_of(NS, key(0)))


def age(tier: StorageTier, ages_s: dict[int, float]) -> None:
    """Set the mtimes of key(i)'s files to `ages_s[i]` seconds ago."""
    now = time.time()
    for i, age_s in ages_s.items():
        os.utime(tier.path_of(NS, key(i)), (now - age_s, now - age_s))


def see_sharing(tier: StorageTier, other: StorageTier) -> None:
    """`tier` adopts a file `other` wrote (in OTHER_NS, removed after): it shares its directory."""
    write(other, key("shared"), ns=OTHER_NS)
    assert tier.contains(OTHER_NS, key("shared"))
    tier.remove(OTHER_NS)
    assert tier.shared


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

    assert os.path.exists(tier.path_of(NS, key(0))) and tier.indexed(NS, key(0))
    assert not os.path.exists(tier.path_of(NS, key(1))) and not tier.indexed(NS, key(1))
    assert tier.stats()["evictions"] == 1 and tier.stats()["used_bytes"] == 3 * file_bytes()
    assert write(tier, key(4))  # key 0 is the most recent now, but for key 3: key 2 goes
    assert not os.path.exists(tier.path_of(NS, key(2))) and os.path.exists(tier.path_of(NS, key(0)))


class CountedStats(FileIO):
    """Real system calls; counts `stat`s of paths, and runs `on_stat(path)` after the next one."""

    def __init__(self) -> None:
        self.stats = 0
        self.on_stat = None

    def stat_path(self, path):
        self.stats += 1
        result = super().stat_path(path)
        hook, self.on_stat = self.on_stat, None
        if hook is not None:
            hook(path)
        return result


def test_a_tier_alone_in_its_directory_evicts_without_looking_at_its_victims(open_tier):
    """Looking at a victim is a `stat` on the write path (a round trip on Lustre): only worth it
    once this tier has seen another write here."""
    io = CountedStats()
    tier = open_tier(capacity=4 * file_bytes(), io=io)
    assert tier.scan_done.wait(10)

    assert all(write(tier, key(i)) for i in range(8))
    assert tier.stats()["evictions"] == 4 and io.stats == 0

    see_sharing(tier, open_tier())
    io.stats = 0
    assert all(write(tier, key(i)) for i in range(8, 10))
    assert tier.stats()["evictions"] == 6 and io.stats == 2


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
    assert not tier.indexed(NS, key(0)) and not os.path.exists(tier.path_of(NS, key(0)))
    assert tier.stats()["used_bytes"] == 3 * file_bytes() and tier.stats()["evictions"] == 1


class HookedUnlinks(FileIO):
    """Real system calls; runs `on_unlink(path)` just before the next unlink."""

    def __init__(self) -> None:
        self.on_unlink = None

    def unlink(self, path, dir_fd=None):
        hook, self.on_unlink = self.on_unlink, None
        if hook is not None:
            hook(path)
        super().unlink(path, dir_fd)


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

    assert found == [False] and not tier.shared
    assert not tier.indexed(NS, key(0)) and tier.stats()["used_bytes"] == 3 * file_bytes()


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

    assert [os.path.exists(tier.path_of(NS, key(i))) for i in range(4)] == [False, True, True, True]
    assert tier.stats()["evictions"] == 1 and tier.stats()["used_bytes"] == 3 * file_bytes()


def test_files_found_by_a_scan_or_a_lookup_share_their_index_values(open_tier):
    """The index keeps per file the minute it knew it used, packed with its size: files scanned
    or adopted get the minute they were found in, not their own mtimes, so files of one size
    share one int (10 million mtimes of their own cost 350 MB); the scan's order is still theirs."""
    first = open_tier()
    for i in range(6):
        write(first, key(i))
    age(first, {i: 3600 * (i + 1) for i in range(6)})
    first.close()
    again = open_tier(capacity=9 * file_bytes())
    assert again.scan_done.wait(10)
    other = open_tier()
    for i in range(6, 9):
        write(other, key(i))
    age(other, {i: 3600 * (i + 1) for i in range(6, 9)})

    assert all(again.contains(NS, key(i)) for i in range(6, 9))  # adopted

    assert len(again._lru) == 9 and len({id(v) for v in again._lru.values()}) <= 3  # the scan's minute, the lookups'
    write(again, key(9))
    assert not os.path.exists(again.path_of(NS, key(5)))  # the oldest mtime scanned: the first evicted


def test_a_file_of_a_terabyte_or_more_is_never_indexed(open_tier):
    """An index value keeps a file's size in 40 bits: a larger file (no KV file of ours) is
    neither adopted by a lookup nor found by a scan, and counts for nothing."""
    tier = open_tier()
    assert tier.scan_done.wait(10)  # else its scan may index the file while it is still empty
    huge = Path(tier.path_of(NS, key(1)))
    huge.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(huge, "wb") as f:
            f.truncate(1 << 40)  # sparse
    except OSError as exc:
        pytest.skip(f"cannot make a sparse file of 1 TiB here: {exc}")

    assert not tier.contains(NS, key(1))
    again = open_tier()
    assert again.scan_done.wait(10)
    assert not again.indexed(NS, key(1)) and again.stats()["used_bytes"] == 0


def test_a_restart_with_a_smaller_capacity_evicts_the_oldest_files(open_tier):
    first = open_tier()
    for i in range(5):
        write(first, key(i))
        os.utime(first.path_of(NS, key(i)), (time.time() - 100 + i, time.time() - 100 + i))
    first.close()

    again = open_tier(capacity=3 * file_bytes())
    assert again.scan_done.wait(10)

    assert eventually(lambda: again.stats()["evictions"] == 2)
    assert [os.path.exists(again.path_of(NS, key(i))) for i in range(5)] == [False, False, True, True, True]
    assert again.stats()["used_bytes"] == 3 * file_bytes()


def test_the_start_up_index_merged_in_slices_keeps_the_files_in_age_order(open_tier, monkeypatch):
    """A large directory is merged into the index a slice at a time (the lock is let go between
    slices); the order of age across slices is the order of one merge."""
    import hpkv.storage.tier as tier_module

    monkeypatch.setattr(tier_module, "_MERGE_SLICE", 2)
    first = open_tier()
    ages = [50, 10, 70, 30, 60, 20, 40]
    for i, age_s in enumerate(ages):
        write(first, key(i))
        os.utime(first.path_of(NS, key(i)), (time.time() - age_s, time.time() - age_s))
    first.close()

    again = open_tier(capacity=len(ages) * file_bytes())
    assert again.scan_done.wait(10)
    assert again.stats()["num_entries"] == len(ages)
    oldest_first = sorted(range(len(ages)), key=lambda i: -ages[i])
    for n, i in enumerate(oldest_first[:4]):
        write(again, key(100 + n))  # each new file evicts the oldest one left
        assert not os.path.exists(again.path_of(NS, key(i))), (n, i)
    assert all(os.path.exists(again.path_of(NS, key(i))) for i in oldest_first[4:])


def test_reading_an_old_file_refreshes_its_age_on_disk(tier):
    k = key(1)
    write(tier, k)
    path = tier.path_of(NS, k)
    old = time.time() - 3600
    os.utime(path, (old, old))

    read(tier, k)

    assert os.stat(path).st_mtime > time.time() - 60


def test_a_one_byte_key_survives_a_restart_and_a_remove(open_tier):
    short = make_key(b"\x07")
    first = open_tier()
    write(first, short)
    first.close()

    again = open_tier()
    assert again.scan_done.wait(10)
    assert again.stats()["files_scanned"] == 1

    assert again.remove(NS) == 1
    assert not os.path.exists(again.path_of(NS, short))


def held_scan() -> type[StorageTier]:
    """A real tier class whose background scan waits at a gate the test opens (`gate.set()`)."""

    class HeldScan(StorageTier):
        gate = threading.Event()

        def _scan(self) -> None:
            self.gate.wait(10)
            super()._scan()

    return HeldScan

def test_lookups_work_while_the_start_up_scan_is_still_running(open_tier):
    HeldScan = held_scan()
    first = open_tier()
    write(first, key(1))
    first.close()

    started = time.monotonic()
    again = open_tier(cls=HeldScan)
    assert time.monotonic() - started < 5  # start() did not wait for the scan

    assert not again.scan_done.is_set()
    assert again.contains(NS, key(1))
    assert read(again, key(1)) == payload(key(1))
    assert not again.scan_done.is_set()

    HeldScan.gate.set()
    assert again.scan_done.wait(10)
    assert again.stats()["num_entries"] == 1
    assert again.stats()["used_bytes"] == file_bytes()  # the scan did not count it twice


# -- temporaries ---------------------------------------------------------------------------------

def make_temp(tier: StorageTier, k: bytes, node: str, pid: int, age_s: float = 0.0) -> Path:
    final = Path(tier.path_of(NS, k))
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.parent / f".{k.hex()}.{node}.{pid}.1.tmp"
    temp.write_bytes(b"half a file")
    if age_s:
        os.utime(temp, (time.time() - age_s, time.time() - age_s))
    return temp


def test_temporaries_of_dead_writers_are_removed_at_start_and_live_ones_kept(open_tier):
    first = open_tier()
    node = first._node
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead_mine = make_temp(first, key(1), node, finished.pid)
    live_mine = make_temp(first, key(2), node, os.getpid())
    fresh_elsewhere = make_temp(first, key(3), "othernode", 12345)
    old_elsewhere = make_temp(first, key(4), "othernode", 12345, age_s=STALE_TEMP_S + 60)
    first.close()

    again = open_tier()
    assert again.scan_done.wait(10)

    assert not dead_mine.exists()
    assert live_mine.exists()
    assert fresh_elsewhere.exists()
    assert not old_elsewhere.exists()
    assert again.stats()["temps_removed"] == 2
    assert again.stats()["num_entries"] == 0  # a temporary is never an entry


# -- several tiers on one root -------------------------------------------------------------------

def test_a_tier_adopts_an_entry_another_tier_wrote(open_tier):
    a, b = open_tier(), open_tier()
    assert a.scan_done.wait(10) and b.scan_done.wait(10)

    write(a, key(1))

    assert b.stats()["num_entries"] == 0
    assert b.contains(NS, key(1))
    assert b.stats()["num_entries"] == 1
    assert read(b, key(1)) == payload(key(1))


def test_an_entry_another_tier_evicted_is_a_miss_and_is_forgotten(open_tier):
    a, b = open_tier(), open_tier()
    write(a, key(1))
    assert b.contains(NS, key(1))

    a.remove(NS)

    assert read(b, key(1)) is None
    assert not b.contains(NS, key(1))
    assert b.stats()["bad_files"] == 0


class HeldWrites(FileIO):
    """Real writes that wait, once started, until the test lets them go on."""

    def __init__(self) -> None:
        self.writing = threading.Event()
        self.go_on = threading.Event()

    def pwritev(self, fd, buffers, offset):
        self.writing.set()
        assert self.go_on.wait(10)
        return super().pwritev(fd, buffers, offset)


def test_two_tiers_writing_one_key_at_once_leave_one_valid_file(open_tier, storage_dir):
    held = HeldWrites()
    a, b = open_tier(io=held), open_tier()
    k = key(1)

    first = a.submit(write, a, k)
    assert held.writing.wait(10)  # a's temporary is open and half written
    second = write(b, k)
    held.go_on.set()

    assert second and first.result(10)
    assert read(a, k) == payload(k) and read(b, k) == payload(k)
    assert temps(storage_dir) == []
    assert len(list(storage_dir.rglob("*.kv"))) == 1


def test_many_threads_of_two_tiers_writing_one_key_leave_one_valid_file(open_tier, storage_dir):
    a, b = open_tier(), open_tier()
    k = key(1)
    start = threading.Barrier(8)
    results = []

    def writer(tier: StorageTier) -> None:
        start.wait()
        results.extend(write(tier, k) for _ in range(20))

    threads = [threading.Thread(target=writer, args=(t,)) for t in (a, b) * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert all(results) and len(results) == 160
    assert read(a, k) == payload(k)
    assert temps(storage_dir) == []
    assert len(list(storage_dir.rglob("*.kv"))) == 1


def test_a_reader_racing_an_evictor_gets_a_miss_or_the_right_bytes(open_tier):
    evictor, reader = open_tier(capacity=2 * file_bytes()), open_tier()
    k = key("raced")
    right = payload(k)
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():  # k is written, then pushed out by two others, again and again
            write(evictor, k)
            write(evictor, key(i))
            write(evictor, key(i + 1))
            i += 2

    thread = threading.Thread(target=churn)
    thread.start()
    hits = misses = wrong = 0
    deadline = time.monotonic() + 3
    try:
        while time.monotonic() < deadline and (hits < 20 or misses < 20):
            got = read(reader, k) if reader.contains(NS, k) else None
            hits, misses = hits + (got is not None), misses + (got is None)
            wrong += got is not None and got != right
    finally:
        stop.set()
        thread.join()

    assert wrong == 0
    assert hits > 0 and misses > 0, (hits, misses)
    assert reader.stats()["bad_files"] == 0  # a lost race is never mistaken for a bad file


# -- a full disk ---------------------------------------------------------------------------------

def test_a_full_disk_evicts_and_later_writes_succeed(open_tier, small_disk):
    size = 256 << 10
    tier = open_tier(root=small_disk, capacity=64 << 20)  # the tier believes it has room
    assert tier.scan_done.wait(10)

    results = [tier.write_from(NS, key(i), memoryview(payload(key(i), size))) for i in range(40)]

    stats = tier.stats()
    assert stats["space_errors"] > 0 and stats["evictions"] > 0
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

    assert tier.stats()["write_failures"] == 1
    assert temps(small_disk) == []


# -- injected I/O faults -------------------------------------------------------------------------

class FailingIO(FileIO):
    """Real system calls, except the ones the test says should fail."""

    def __init__(self, read_errno: int = 0, write_errno: int = 0, short_writes: int = 0,
                 no_space_writes: int = 0) -> None:
        self.read_errno = read_errno
        self.write_errno = write_errno
        self.short_writes = short_writes  # how many writes stop halfway; -1 for all
        self.no_space_writes = no_space_writes  # how many writes fail with ENOSPC

    def preadv(self, fd, buffers, offset):
        if self.read_errno:
            raise OSError(self.read_errno, os.strerror(self.read_errno))
        return super().preadv(fd, buffers, offset)

    def pwritev(self, fd, buffers, offset):
        if self.write_errno:
            raise OSError(self.write_errno, os.strerror(self.write_errno))
        if self.no_space_writes:
            self.no_space_writes -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.short_writes:
            self.short_writes -= 1
            return os.pwrite(fd, bytes(buffers[0]), offset)  # the header only
        return super().pwritev(fd, buffers, offset)


def test_an_io_error_on_write_is_a_dropped_write(open_tier, storage_dir):
    tier = open_tier(io=FailingIO(write_errno=errno.EIO))

    assert not write(tier, key(1))

    assert not tier.contains(NS, key(1))
    assert tier.stats()["write_failures"] == 1
    assert tier.stats()["used_bytes"] == 0
    assert temps(storage_dir) == []


def test_an_io_error_on_read_is_a_miss(open_tier, storage_dir):
    io = FailingIO()
    tier = open_tier(io=io)
    write(tier, key(1))
    io.read_errno = errno.EIO

    assert read(tier, key(1)) is None
    assert os.path.exists(tier.path_of(NS, key(1)))  # the medium failed, not the file: kept
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
    assert tier.stats()["bad_files"] == 0 and tier.stats()["reads"] == 1


def test_a_read_that_ends_short_is_a_miss_and_keeps_the_file(open_tier, caplog):
    """Only a file read whole that fails its checks is deleted."""
    io = ShortReads(4096)
    tier = open_tier(io=io)
    write(tier, key(1))
    io.ended = True

    assert read(tier, key(1)) is None and read(tier, key(1)) is None

    assert os.path.exists(tier.path_of(NS, key(1))) and tier.indexed(NS, key(1))
    assert tier.stats()["bad_files"] == 0 and tier.stats()["read_misses"] == 2
    assert caplog.text.count("cannot read KV files") == 1
    io.ended = False
    assert read(tier, key(1)) == payload(key(1))


def test_read_errors_are_said_again_after_a_while_not_once_for_good(open_tier, caplog, monkeypatch):
    """A device that fails, recovers, and fails again hours later is said again: one kind of
    error at most every WARN_EVERY_S, counted always."""
    import hpkv.storage.tier as tier_module

    monkeypatch.setattr(tier_module, "WARN_EVERY_S", 0.5)
    io = ShortReads(4096)
    tier = open_tier(io=io)
    write(tier, key(1))
    io.ended = True

    assert read(tier, key(1)) is None and read(tier, key(1)) is None
    assert caplog.text.count("cannot read KV files") == 1
    time.sleep(0.6)
    assert read(tier, key(1)) is None

    assert caplog.text.count("cannot read KV files") == 2
    assert tier.stats()["read_misses"] == 3


class RefusedOpens(FileIO):
    """Real opens, but of entry files for reading, refused with `errno` while it is set."""

    def __init__(self) -> None:
        self.errno = 0

    def open(self, path, flags, mode=0o600, dir_fd=None):
        if self.errno and path.endswith(".kv") and not flags & os.O_WRONLY:
            raise OSError(self.errno, os.strerror(self.errno), path)
        return super().open(path, flags, mode, dir_fd)


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
    assert os.path.exists(tier.path_of(NS, key(1)))  # not this tier's to delete
    assert tier.stats()["used_bytes"] == 0 and tier.stats()["bad_files"] == 0
    assert caplog.text.count("cannot read KV files") == 1
    io.errno = 0
    assert write(tier, key(1)) and tier.contains(NS, key(1))
    assert read(tier, key(1)) == payload(key(1))


class RefusedAndCounted(RefusedOpens, CountedStats):
    def __init__(self) -> None:
        RefusedOpens.__init__(self)
        CountedStats.__init__(self)


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

    assert [tier.indexed(NS, key(i)) for i in range(4)] == [os.path.exists(tier.path_of(NS, key(i)))
                                                            for i in range(4)]
    assert not tier.indexed(NS, key(0)) and tier.stats()["used_bytes"] == file_bytes()


def test_a_victim_spared_while_another_namespace_is_removed_comes_back(open_tier):
    io = CountedStats()
    tier = spare_key_0(open_tier, io)
    io.on_stat = lambda path: tier.remove(OTHER_NS)  # while the eviction looks at key 0

    assert write(tier, key(3))

    assert tier.indexed(NS, key(0)) and os.path.exists(tier.path_of(NS, key(0)))
    assert [os.path.exists(tier.path_of(NS, key(i))) for i in range(1, 4)] == [False, True, True]
    assert tier.stats()["used_bytes"] == 3 * file_bytes() and tier.stats()["evictions"] == 1


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
    assert tier.stats()["used_bytes"] == 3 * file_bytes()  # keys 1 (or 2), 3 and the one left


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
    assert tier.stats()["write_failures"] == 1


def two_files_the_device_fails_to_read(open_tier) -> tuple[StorageTier, "FailingIO"]:
    """Keys 1 and 2 written, then read while the device fails (EIO); the device still fails."""
    io = FailingIO()
    tier = open_tier(io=io)
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


def test_a_device_error_passes_and_the_file_is_found_again(open_tier, monkeypatch):
    """EIO often passes (a Lustre client evicted, an NFS soft timeout): the file is a miss for a
    while, then a lookup adopts it again and its bytes count again; a read that succeeds
    meanwhile ends the while at once."""
    import hpkv.storage.tier as tier_module

    monkeypatch.setattr(tier_module, "UNREADABLE_EIO_S", 3.0)  # long enough for the steps before its end
    tier, io = two_files_the_device_fails_to_read(open_tier)
    assert not tier.contains(NS, key(1)) and tier.stats()["used_bytes"] == 0
    io.read_errno = 0

    assert read(tier, key(2)) == payload(key(2))  # a promotion queued before the error, say
    assert tier.contains(NS, key(2)) and not tier.contains(NS, key(1))
    time.sleep(3.1)
    assert tier.contains(NS, key(1))

    assert tier.stats()["used_bytes"] == 2 * file_bytes() and tier.stats()["num_entries"] == 2
    assert read(tier, key(1)) == payload(key(1))


def test_an_injected_no_space_error_evicts_and_retries(open_tier, storage_dir):
    io = FailingIO()
    tier = open_tier(io=io)
    write(tier, key(0))
    io.no_space_writes = 1

    assert write(tier, key(1))

    assert tier.stats()["space_errors"] == 1
    assert not os.path.exists(tier.path_of(NS, key(0)))  # evicted to make room
    assert read(tier, key(1)) == payload(key(1))
    assert temps(storage_dir) == []


def test_one_no_room_that_an_eviction_cures_does_not_shrink_the_tier(open_tier):
    """A Lustre OST full for a moment: the retry after a little eviction fits, so nothing is
    learned. Learning from each such error shrank the tier to one file under intermittent ones."""
    tier = open_tier(capacity=64 * file_bytes())
    assert tier.scan_done.wait(10)
    io = tier.io = FailingIO()
    assert all(write(tier, key(i)) for i in range(8))

    for i in range(100, 105):
        io.no_space_writes = 1
        assert write(tier, key(i))

    stats = tier.stats()
    assert stats["capacity_bytes"] == 64 * file_bytes() and stats["space_errors"] == 5


def test_a_quota_met_teaches_the_tier_its_capacity_and_evicts_little(open_tier, caplog):
    """HPKV_KV_STORAGE_SIZE=auto on a shared file system of petabytes, under a user quota: the
    first "no room" evicts a few files (not 1% of petabytes: the whole directory, other nodes'
    files too), and the tier holds at most what fitted from then on, saying so once."""
    tier = open_tier(capacity=1 << 52)
    assert tier.scan_done.wait(10)
    io = tier.io = FailingIO()
    assert all(write(tier, key(i)) for i in range(200))
    io.no_space_writes = 2  # no room even after a little eviction: the limit is real

    assert not write(tier, key("new"))

    stats = tier.stats()
    assert stats["capacity_bytes"] == 196 * file_bytes()
    assert stats["evictions"] == 4 and stats["space_errors"] == 2 and stats["num_entries"] == 196
    assert [os.path.exists(tier.path_of(NS, key(i))) for i in range(6)] == [False] * 4 + [True] * 2
    said = [r.getMessage() for r in caplog.records if "has no room for more KV files" in r.getMessage()]
    assert len(said) == 1 and "HPKV_KV_STORAGE_SIZE" in said[0]
    assert all(write(tier, key(i)) for i in range(200, 210))  # within what it learned: evicted LRU, no error
    assert tier.stats()["space_errors"] == 2 and tier.stats()["used_bytes"] <= 196 * file_bytes()


def a_tier_that_learned_its_room(open_tier) -> tuple[StorageTier, "FailingIO"]:
    """A tier sized for 64 files holding 8, whose next write met "no room" twice: it learned
    that what it held (after a little eviction) is what fits."""
    tier = open_tier(capacity=64 * file_bytes())
    assert tier.scan_done.wait(10)
    io = tier.io = FailingIO()
    assert all(write(tier, key(i)) for i in range(8))
    io.no_space_writes = 2
    assert not write(tier, key("new"))
    return tier, io

def test_a_learned_capacity_goes_back_to_the_size_after_a_while_without_no_room(open_tier, caplog, monkeypatch):
    """A quota met once (others' files took the room, say) is not a capacity for good: after
    CAPACITY_RECOVERY_S without another "no room", the tier holds what it was sized to again,
    and the warning says when."""
    import hpkv.storage.tier as tier_module

    monkeypatch.setattr(tier_module, "CAPACITY_RECOVERY_S", 0.5)
    tier, _ = a_tier_that_learned_its_room(open_tier)
    assert tier.stats()["capacity_bytes"] == 4 * file_bytes()  # what was left after a little eviction
    said = next(r.getMessage() for r in caplog.records if "has no room for more KV files" in r.getMessage())
    assert "minutes pass without such an error, when it tries that size again" in said

    time.sleep(0.6)
    assert all(write(tier, key(i)) for i in range(100, 110))

    assert tier.stats()["capacity_bytes"] == 64 * file_bytes()
    assert tier.stats()["num_entries"] == 14 and tier.stats()["evictions"] == 4


def test_a_no_room_that_an_eviction_cures_does_not_hold_off_the_recovery(open_tier, monkeypatch):
    """Recovery counts from the last "no room" that taught something: a Lustre OST full for a
    moment every few minutes, cured by the next eviction, must not keep the tier small."""
    import hpkv.storage.tier as tier_module

    monkeypatch.setattr(tier_module, "CAPACITY_RECOVERY_S", 2.0)
    tier, io = a_tier_that_learned_its_room(open_tier)
    learned_at = time.monotonic()
    assert tier.stats()["capacity_bytes"] < 64 * file_bytes()
    time.sleep(1.0)
    io.no_space_writes = 1
    assert write(tier, key("cured"))  # one "no room", then room after a little eviction

    time.sleep(max(0.0, learned_at + 2.3 - time.monotonic()))
    assert write(tier, key("later"))
    assert tier.stats()["capacity_bytes"] == 64 * file_bytes()


def test_a_recovery_decided_before_a_new_no_room_keeps_what_that_one_taught(open_tier):
    """A write found the learned capacity old enough to recover; before it recovers, another
    write meets "no room" twice and learns again: the recovery must not undo that."""
    tier, io = a_tier_that_learned_its_room(open_tier)

    tier._recover_capacity()  # the first write, going on past its check

    assert tier.stats()["capacity_bytes"] == 4 * file_bytes()


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

    assert again.stats()["space_errors"] == 1 and again.stats()["capacity_bytes"] == 64 * file_bytes()
    assert again.stats()["evictions"] == 1  # key 10: all the index held
    HeldScan.gate.set()
    assert again.scan_done.wait(10)
    assert again.stats()["capacity_bytes"] == 64 * file_bytes() and again.stats()["num_entries"] == 11
    assert all(os.path.exists(again.path_of(NS, key(i))) for i in range(10))


def test_no_room_that_one_eviction_does_not_cure_drops_the_write(open_tier):
    """A write is given up (a miss later) rather than evicting again and again."""
    io = FailingIO()
    tier = open_tier(io=io)
    assert all(write(tier, key(i)) for i in range(20))
    io.write_errno = errno.EDQUOT

    assert not write(tier, key("new"))

    stats = tier.stats()
    assert stats["evictions"] == 4 and stats["space_errors"] == 2 and stats["write_failures"] == 1
    assert stats["num_entries"] == 16


def test_a_namespace_directory_removed_under_the_tier_is_made_again(tier, storage_dir):
    """The tier remembers the directories it made: one removed under it (`rm -rf` of the root or
    of a namespace) is made again, and the write is not lost."""
    assert write(tier, key(1))
    shutil.rmtree(storage_dir / NS)

    assert write(tier, key(1))

    assert read(tier, key(1)) == payload(key(1))
    assert tier.stats()["write_failures"] == 0


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
        assert write_entry_file(tier.io, target, [header, payload(k)], "off") is None
        return OSError(errno.EIO, "the write-through process 1234 exited (-9)")

    assert tier.publish(NS, k, ENTRY, fmt.VERSION, killed_after_rename)

    assert tier.indexed(NS, k) and tier.stats()["used_bytes"] == file_bytes()
    assert tier.stats()["write_failures"] == 0
    assert read(tier, k) == payload(k)


def test_one_short_write_is_retried_and_the_file_is_whole(open_tier, storage_dir):
    tier = open_tier(io=FailingIO(short_writes=1))

    assert write(tier, key(1))

    assert read(tier, key(1)) == payload(key(1))
    assert temps(storage_dir) == []


def test_writes_that_always_stop_short_are_dropped_and_leave_nothing(open_tier, storage_dir):
    tier = open_tier(io=FailingIO(short_writes=-1))

    assert not write(tier, key(1))

    assert not os.path.exists(tier.path_of(NS, key(1)))
    assert temps(storage_dir) == []
    assert tier.stats()["write_failures"] == 1


# -- durability ----------------------------------------------------------------------------------

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


# -- the storage root ----------------------------------------------------------------------------

def test_a_storage_root_that_is_a_file_is_refused_naming_path_and_setting(tmp_path):
    root = tmp_path / "a-file"
    root.write_text("not a directory")
    tier = StorageTier(make_storage_config(root, 1 << 20))
    try:
        with pytest.raises(StorageError) as caught:
            tier.start()
    finally:
        tier.close()

    assert str(root) in str(caught.value)
    assert "is not a directory" in str(caught.value)
    assert isinstance(caught.value, StorageUnusable)  # the server goes on with DRAM alone
    assert "HPKV_KV_STORAGE_PATH" in str(caught.value)


def test_a_storage_root_below_a_file_is_refused(tmp_path):
    root = tmp_path / "a-file" / "storage"
    root.parent.write_text("not a directory")
    tier = StorageTier(make_storage_config(root, 1 << 20))
    try:
        with pytest.raises(StorageError, match="HPKV_KV_STORAGE_PATH"):
            tier.start()
    finally:
        tier.close()


def test_a_read_only_storage_root_is_refused_naming_path_and_setting(tmp_path):
    root = tmp_path / "read-only"
    mount_tmpfs(root, "ro,size=1m")
    tier = StorageTier(make_storage_config(root, 1 << 20))
    try:
        with pytest.raises(StorageError) as caught:
            tier.start()
    finally:
        tier.close()
        subprocess.run(["umount", "-l", str(root)], check=True)

    assert str(root) in str(caught.value)
    assert "read-only mount" in str(caught.value) and "mount -o remount,rw" in str(caught.value)
    assert isinstance(caught.value, StorageUnusable)
    assert "HPKV_KV_STORAGE_PATH" in str(caught.value)


def test_a_missing_storage_root_is_created(tmp_path, open_tier):
    root = tmp_path / "new" / "storage"

    tier = open_tier(root=root)

    assert root.is_dir()
    assert write(tier, key(1))


def test_an_automatic_capacity_is_a_share_of_the_free_space(open_tier, small_disk):
    tier = open_tier(root=small_disk, capacity=None)
    assert tier.scan_done.wait(10)

    assert 0.7 * (4 << 20) < tier.capacity_bytes <= 0.8 * (4 << 20)


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

        assert 0.3 * mem_available_bytes() < tier.capacity_bytes < 0.5 * mem_available_bytes()
        assert write(tier, key(1))
        assert list((point / "storage").rglob("*.kv")) == [Path(tier.path_of(NS, key(1)))]
        said = [r.getMessage() for r in caplog.records if "memory file system" in r.getMessage()]
        assert len(said) == 1 and "ramfs" in said[0] and "lost at reboot" in said[0]
        assert "HPKV_KV_STORAGE_SIZE=auto gave" in said[0]
        assert not [r for r in caplog.records if "storage tier holds only" in r.getMessage()]
        tier.close()
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True)


def test_an_automatic_capacity_on_ramfs_leaves_out_the_pool_and_a_container_s_limit(open_tier, tmp_path,
                                                                                    monkeypatch, caplog):
    """The host says 64 GiB available, the container's cgroup leaves 24 GiB, and a 10 GiB pool on
    ramfs will take its pages later: auto is 80% of half of the 14 GiB left."""
    from helpers.machine import GIB, pretend

    point = tmp_path / "ram"
    pretend(monkeypatch, tmp_path, 64 * GIB, ramfs=(point,), cgroup="/ctr", limits={"/ctr": (str(32 * GIB), 8 * GIB, 0)})

    with caplog.at_level("WARNING", logger="hpkv.storage.tier"):
        tier = StorageTier(make_storage_config(point / "storage", None))
        tier.start(promised_ram_bytes=10 * GIB)
    try:
        assert tier.scan_done.wait(10)
        assert tier.capacity_bytes == int(7 * GIB * 0.8)
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

    assert tier.capacity_bytes == 0
    warning = next(r.getMessage() for r in caplog.records if "storage tier holds only" in r.getMessage())
    assert str(small_disk / "kv") in warning and "are not written" in warning
    assert "HPKV_KV_STORAGE_SIZE" in warning
    assert not write(tier, key(1))
    assert list((small_disk / "kv").rglob("*.kv")) == []


def test_an_automatic_capacity_counts_the_tiers_own_files_and_is_not_a_warning_then(open_tier, small_disk,
                                                                                      caplog, monkeypatch):
    """A disk full of HPKV's own files is not a full disk: its files count toward the capacity."""
    import hpkv.storage.tier as tier_module

    first = open_tier(root=small_disk, capacity=None)
    assert first.scan_done.wait(10)
    written = sum(write(first, key(i)) for i in range(8))
    assert written == 8
    monkeypatch.setattr(tier_module, "SMALL_AUTO_CAPACITY", 4 * file_bytes())  # this disk's scale
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
    assert int(own) <= again.capacity_bytes < own + 0.8 * (64 << 10)  # the filler leaves under 64 KiB free
    assert not [r for r in caplog.records if "storage tier holds only" in r.getMessage()]


def test_a_storage_path_on_a_kernel_pseudo_file_system_is_refused_at_start(open_tier):
    with pytest.raises(StorageError) as caught:
        open_tier(root=Path("/proc/hpkv-storage"))

    message = str(caught.value)
    assert "/proc/hpkv-storage" in message and "proc" in message and "pseudo file system" in message
    assert "HPKV_KV_STORAGE_PATH" in message
    assert not Path("/proc/hpkv-storage").exists()


def test_a_storage_path_below_a_file_names_the_file(open_tier, tmp_path):
    (tmp_path / "a-file").write_text("")

    with pytest.raises(StorageError) as caught:
        open_tier(root=tmp_path / "a-file" / "storage")

    assert f"{tmp_path / 'a-file'} is a file, not a directory" in str(caught.value)
    assert "HPKV_KV_STORAGE_PATH" in str(caught.value)


# -- remove --------------------------------------------------------------------------------------

def test_remove_of_one_namespace_deletes_only_its_files(tier, storage_dir):
    for i in range(3):
        write(tier, key(i), NS)
        write(tier, key(i), OTHER_NS)

    assert tier.remove(NS) == 3

    assert list((storage_dir / NS).rglob("*.kv")) == []
    assert len(list((storage_dir / OTHER_NS).rglob("*.kv"))) == 3
    assert read(tier, key(0), NS) is None
    assert read(tier, key(0), OTHER_NS) == payload(key(0))
    assert tier.stats()["num_entries"] == 3
    assert tier.stats()["used_bytes"] == 3 * file_bytes()


def test_remove_deletes_files_another_tier_wrote(open_tier, storage_dir):
    a, b = open_tier(), open_tier()
    write(a, key(1))

    assert b.remove() == 1

    assert list(storage_dir.rglob("*.kv")) == []


def test_entry_files_and_directories_are_private_to_their_owner(open_tier, storage_dir):
    tier = open_tier()
    write(tier, key(3))
    path = tier.path_of(NS, key(3))
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700


def test_entries_removed_while_the_start_up_scan_runs_do_not_come_back(open_tier):
    class GatedMerge(StorageTier):
        """The walk has found the files; the merge waits at a gate the test opens."""

        gate, walked = threading.Event(), threading.Event()

        def _merge(self, found):
            self.walked.set()
            self.gate.wait(10)
            super()._merge(found)

    first = open_tier()
    for i in range(4):
        write(first, key(i))
        write(first, key(i), ns=OTHER_NS)
    first.close()
    with open(first.path_of(NS, key(2)), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")

    again = open_tier(cls=GatedMerge)
    assert GatedMerge.walked.wait(10)
    assert read(again, key(2)) is None  # a bad file: removed during the scan
    again.remove(OTHER_NS)  # a whole namespace cleared during the scan
    GatedMerge.gate.set()
    assert again.scan_done.wait(10)

    assert [again.contains(NS, key(i)) for i in range(4)] == [True, True, False, True]
    assert not any(again.contains(OTHER_NS, key(i)) for i in range(4))
    assert again.stats()["used_bytes"] == 3 * file_bytes()


def test_a_full_set_of_unreadable_marks_drops_those_past_their_time_first(open_tier, monkeypatch):
    """Room for four marks: three past their time and one for good (a file this tier is refused).
    A fifth mark drops the three, not the one for good (which would be a hit again)."""
    import hpkv.storage.tier as tier_module

    monkeypatch.setattr(tier_module, "MAX_UNREADABLE", 4)
    tier = open_tier()
    with tier._lock:
        for i in range(3):
            tier._mark_unreadable(b"past%d" % i, -1.0)
        tier._mark_unreadable(b"refused", math.inf)
        tier._mark_unreadable(b"new", 60.0)

    assert sorted(tier._unreadable) == [b"new", b"refused"]


def test_a_mark_past_its_time_is_not_dropped_once_marked_again(open_tier):
    """A lookup finds a mark past its time while a failed read marks the file again: the new
    mark stays."""
    tier = open_tier()

    class MarkedAgainMeanwhile(dict):
        def get(self, k, default=None):
            value = super().get(k, default)
            if k == b"ik" and not hasattr(self, "done"):
                self.done = True
                self[k] = math.inf  # the failed read, between the lookup's get and its pop
            return value

    tier._unreadable = MarkedAgainMeanwhile({b"ik": time.monotonic() - 1})

    assert not tier._is_unreadable(b"ik")

    assert tier._is_unreadable(b"ik")
