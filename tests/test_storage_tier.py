"""Stories about the storage tier as a whole (`StorageTier`): entries that read back, their files,
namespaces, the storage root at start, several tiers on one root, and removes."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from helpers import storage_stories as stories
from helpers.config import make_storage_config
from helpers.storage_stories import ENTRY, NS, OTHER_NS, file_bytes, key, mount_tmpfs, payload, read, temps, write
from hpkv.errors import StorageError
from hpkv.storage.fileio import FileIO
from hpkv.storage.root import StorageUnusable
from hpkv.storage.storage_tier import StorageTier

open_tier, tier, small_disk = stories.open_tier, stories.tier, stories.small_disk


# -- files ------------------------------------------------------------------------------------


def test_an_entry_written_reads_back_identical(tier):
    k = key(1)

    assert write(tier, k)

    assert tier.contains(NS, k)
    assert read(tier, k) == payload(k)
    assert tier.stats().reads == 1 and tier.stats().writes == 1


def test_an_entry_lives_in_its_fanned_out_file_and_leaves_no_temporary(tier, storage_dir):
    k = key(1)
    write(tier, k)

    name = k.hex()
    path = storage_dir / NS / name[0:2] / name[2:4] / f"{name}.kv"
    assert tier.paths.path_of(NS, k) == str(path)
    assert path.stat().st_size == file_bytes(k)
    assert temps(storage_dir) == []


def test_a_key_never_written_is_a_miss(tier):
    assert not tier.contains(NS, key(1))
    assert read(tier, key(1)) is None
    assert tier.stats().read_misses == 1


def test_the_same_key_in_two_namespaces_is_two_entries(tier):
    k = key(1)
    tier.write_from(NS, k, memoryview(b"a" * ENTRY))
    tier.write_from(OTHER_NS, k, memoryview(b"b" * ENTRY))

    assert read(tier, k, NS) == b"a" * ENTRY
    assert read(tier, k, OTHER_NS) == b"b" * ENTRY


def test_the_namespace_description_is_kept_beside_the_data(tier, storage_dir):
    assert (storage_dir / NS / "namespace.json").read_text() == '{"test": true}\n'


def test_entry_files_and_directories_are_private_to_their_owner(open_tier, storage_dir):
    tier = open_tier()
    write(tier, key(3))
    path = tier.paths.path_of(NS, key(3))
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700


# -- several tiers on one root ----------------------------------------------------------------


def test_a_tier_adopts_an_entry_another_tier_wrote(open_tier):
    a, b = open_tier(), open_tier()
    assert a.scan_done.wait(10) and b.scan_done.wait(10)

    write(a, key(1))

    assert b.stats().num_entries == 0
    assert b.contains(NS, key(1))
    assert b.stats().num_entries == 1
    assert read(b, key(1)) == payload(key(1))


def test_an_entry_another_tier_evicted_is_a_miss_and_is_forgotten(open_tier):
    a, b = open_tier(), open_tier()
    write(a, key(1))
    assert b.contains(NS, key(1))

    a.remove(NS)

    assert read(b, key(1)) is None
    assert not b.contains(NS, key(1))
    assert b.stats().bad_files == 0


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
    assert reader.stats().bad_files == 0  # a lost race is never mistaken for a bad file


# -- the storage root -------------------------------------------------------------------------


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


# -- remove -----------------------------------------------------------------------------------


def test_remove_of_one_namespace_deletes_only_its_files(tier, storage_dir):
    for i in range(3):
        write(tier, key(i), NS)
        write(tier, key(i), OTHER_NS)

    assert tier.remove(NS) == 3

    assert list((storage_dir / NS).rglob("*.kv")) == []
    assert len(list((storage_dir / OTHER_NS).rglob("*.kv"))) == 3
    assert read(tier, key(0), NS) is None
    assert read(tier, key(0), OTHER_NS) == payload(key(0))
    assert tier.stats().num_entries == 3
    assert tier.stats().used_bytes == 3 * file_bytes()


def test_remove_deletes_files_another_tier_wrote(open_tier, storage_dir):
    a, b = open_tier(), open_tier()
    write(a, key(1))

    assert b.remove() == 1

    assert list(storage_dir.rglob("*.kv")) == []
