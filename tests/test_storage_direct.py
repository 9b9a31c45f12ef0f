"""Stories about direct I/O (HPKV_KV_STORAGE_DIRECT_IO): entry files written and read with
O_DIRECT in the aligned file format, never through the page cache; files of either format read
by tiers of either setting; and a file system or a buffer that refuses O_DIRECT costing nothing
but the page cache."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import mmap
import os
from pathlib import Path

import pytest

from helpers.config import make_storage_config
from hpkv.config import load_settings
from hpkv.storage import fileio
from hpkv.storage import format as fmt
from hpkv.storage.fileio import O_DIRECT, FileIO
from hpkv.storage.storage_tier import StorageTier
from test_storage_tier import NS, key, payload
from test_store import desc, keys, load, open_store, save  # noqa: F401 (a fixture)
from test_store import payload as store_payload

ENTRY = 64 << 10  # a multiple of 4 KiB, as KV pages are

_libc = ctypes.CDLL(None, use_errno=True)


def cached_bytes(path: Path) -> int:
    """How many bytes of the file the page cache holds (mincore over a mapping of it)."""
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        return sum(mmap.PAGESIZE for v in vec if v & 1)


def pool_buffer(size: int = ENTRY) -> mmap.mmap:
    """Page-aligned memory, as a pool slot is."""
    return mmap.mmap(-1, size)


class RecordingIO(FileIO):
    """Notes whether each open asked for O_DIRECT."""

    def __init__(self) -> None:
        self.opens: list[tuple[str, bool]] = []

    def open(self, path: str, flags: int, mode: int = 0o600, dir_fd: int | None = None) -> int:
        self.opens.append((os.path.basename(path), bool(flags & O_DIRECT)))
        return super().open(path, flags, mode, dir_fd)


class RefusingIO(FileIO):
    """A file system without O_DIRECT: the open fails with EINVAL, after creating the file, as
    Linux does for such file systems."""

    def open(self, path: str, flags: int, mode: int = 0o600, dir_fd: int | None = None) -> int:
        if flags & O_DIRECT:
            if flags & os.O_CREAT:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, mode, dir_fd=dir_fd))
            raise OSError(errno.EINVAL, "Invalid argument")
        return super().open(path, flags, mode, dir_fd)


class UnalignedWritesIO(FileIO):
    """O_DIRECT opens succeed but direct writes fail with EINVAL (a device with larger sectors)."""

    def __init__(self) -> None:
        self.refused = 0

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT:
            self.refused += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return super().pwritev(fd, buffers, offset)


def direct_config(root: Path, on: bool = True):
    return dataclasses.replace(make_storage_config(root), direct_io=on)


@pytest.fixture
def open_tier(storage_dir):
    tiers = []

    def _open(direct: bool = True, io: FileIO | None = None, root: Path = storage_dir) -> StorageTier:
        tier = StorageTier(direct_config(root, direct), io)
        tiers.append(tier)
        tier.start()
        tier.add_namespace(NS, '{"test": true}')
        return tier

    yield _open
    for tier in tiers:
        tier.close()


def write(tier: StorageTier, k: bytes) -> bool:
    src = pool_buffer()
    src[:] = payload(k, ENTRY)
    return tier.write_from(NS, k, memoryview(src))


def read(tier: StorageTier, k: bytes, aligned: bool = True) -> bytes | None:
    dest = pool_buffer() if aligned else bytearray(ENTRY + 1)
    view = memoryview(dest)[:ENTRY] if not aligned else memoryview(dest)
    return bytes(view) if tier.read_into(NS, k, view) else None


def entry_path(tier: StorageTier, k: bytes) -> Path:
    return Path(tier.paths.path_of(NS, k))


def version_on_disk(path: Path) -> int:
    """The header's format version (read through the page cache: check `cached_bytes` first)."""
    return int.from_bytes(path.read_bytes()[8:10], "little")


def test_the_file_system_here_takes_direct_io(storage_dir):
    assert fileio.direct_supported(str(storage_dir))
    assert not list(storage_dir.iterdir())  # the probe leaves nothing behind


def test_a_direct_write_and_read_bypass_the_page_cache_and_keep_the_bytes(open_tier):
    io = RecordingIO()
    tier = open_tier(io=io)
    assert tier.reader.direct and tier.stats().direct_io
    k = key("direct")
    assert write(tier, k)
    path = entry_path(tier, k)
    assert cached_bytes(path) == 0  # nothing of it went through the page cache
    assert read(tier, k) == payload(k, ENTRY)
    assert cached_bytes(path) == 0
    assert [direct for _, direct in io.opens] == [True, True]  # the write's temporary, then the read
    assert path.stat().st_size == fmt.ALIGN + ENTRY and version_on_disk(path) == fmt.VERSION_ALIGNED


def test_a_buffered_tier_leaves_its_files_in_the_page_cache(open_tier):
    """The contrast that makes the test above mean something."""
    tier = open_tier(direct=False)
    k = key("buffered")
    assert write(tier, k)
    path = entry_path(tier, k)
    assert version_on_disk(path) == fmt.VERSION and path.stat().st_size == fmt.header_bytes(len(k)) + ENTRY
    assert cached_bytes(path) > ENTRY // 2


def test_files_of_either_format_read_back_in_tiers_of_either_setting(open_tier, storage_dir):
    buffered, direct = open_tier(direct=False), open_tier(direct=True)
    old, new = key("v1"), key("v2")
    assert write(buffered, old) and write(direct, new)
    for tier in (buffered, direct):
        for k in (old, new):
            assert read(tier, k) == payload(k, ENTRY)
            assert read(tier, k, aligned=False) == payload(k, ENTRY)  # a buffer O_DIRECT cannot use
    assert StorageTier(direct_config(storage_dir)).counters.bad_files == 0


def test_a_restarted_direct_tier_counts_the_aligned_files_it_finds(open_tier):
    tier = open_tier()
    ks = [key(i) for i in range(5)]
    assert all(write(tier, k) for k in ks)
    used = tier.index.used_bytes
    assert used == 5 * (fmt.ALIGN + ENTRY)
    again = open_tier()
    assert again.scan_done.wait(10)
    assert again.index.used_bytes == used
    assert [read(again, k) for k in ks] == [payload(k, ENTRY) for k in ks]


@pytest.mark.parametrize("damage", ["padding", "payload", "truncated", "version 1 header size"])
def test_a_damaged_aligned_file_is_a_miss_and_is_removed(open_tier, damage):
    tier = open_tier()
    k = key(damage)
    assert write(tier, k)
    path = entry_path(tier, k)
    data = bytearray(path.read_bytes())
    if damage == "padding":
        data[fmt.ALIGN - 1] ^= 1  # inside the header's zero padding, outside both checksums
    elif damage == "payload":
        data[fmt.ALIGN + 100] ^= 1
    elif damage == "truncated":
        data = data[: -fmt.ALIGN]
    else:  # the header of version 2 in a file of version 1's size
        data = data[: fmt.header_bytes(len(k))] + data[fmt.ALIGN :]
    path.write_bytes(bytes(data))
    assert read(tier, k) is None
    assert not path.exists() and tier.counters.bad_files == 1


def test_a_file_system_that_refuses_direct_io_gets_the_same_files_through_the_page_cache(
    open_tier, storage_dir, caplog
):
    tier = open_tier(io=RefusingIO())
    k = key("refused")
    assert write(tier, k)
    path = entry_path(tier, k)
    assert version_on_disk(path) == fmt.VERSION_ALIGNED and cached_bytes(path) > 0
    assert not list(storage_dir.rglob("*.tmp"))
    with caplog.at_level("WARNING", logger="hpkv.storage.tier"):
        assert read(tier, k) == payload(k, ENTRY)  # its read falls back too, and from then on
        assert read(tier, k) == payload(k, ENTRY)
    assert not tier.reader.direct
    refusals = [r.getMessage() for r in caplog.records if "refused O_DIRECT on a read" in r.getMessage()]
    assert len(refusals) == 1 and str(tier.root) in refusals[0]  # said once, naming the directory


def test_direct_writes_a_device_refuses_are_written_through_the_page_cache(open_tier):
    io = UnalignedWritesIO()
    tier = open_tier(io=io)
    k = key("sectors")
    assert write(tier, k)
    assert io.refused == 1
    assert read(tier, k) == payload(k, ENTRY)


def test_a_storage_root_without_direct_io_is_said_once_at_start(open_tier, monkeypatch, caplog, storage_dir):
    monkeypatch.setattr("hpkv.storage.storage_tier.direct_supported", lambda directory: False)
    with caplog.at_level(logging.WARNING, logger="hpkv.storage.tier"):
        tier = open_tier()
    assert not tier.reader.direct
    assert [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()] == [
        f"the file system of {storage_dir} does not take O_DIRECT (HPKV_KV_STORAGE_DIRECT_IO=on); KV files go "
        "through the page cache instead"
    ]
    k = key("plain")
    assert write(tier, k)
    assert version_on_disk(entry_path(tier, k)) == fmt.VERSION


def test_an_entry_size_direct_io_cannot_take_is_written_in_the_plain_format(open_tier):
    tier = open_tier()
    k = key("odd")
    src = bytes(payload(k, 5000))
    assert tier.write_from(NS, k, memoryview(src))
    path = entry_path(tier, k)
    assert version_on_disk(path) == fmt.VERSION and path.stat().st_size == fmt.header_bytes(len(k)) + 5000
    dest = bytearray(5000)
    assert tier.read_into(NS, k, memoryview(dest)) and bytes(dest) == src


def test_write_through_processes_write_aligned_files_with_direct_io(open_store, storage_dir):  # noqa: F811
    store = open_store(storage=direct_config(storage_dir))
    ns = store.register(desc())
    ks = keys(6)
    assert save(store, ns, ks) == 6 and store.flush(timeout=20)
    assert store.writers is not None and store.writers.pids()  # written by the child processes
    size = store.namespaces()[ns].entry_bytes
    for k in ks:
        path = Path(store.storage.paths.path_of(ns, k))
        assert cached_bytes(path) == 0 and version_on_disk(path) == fmt.VERSION_ALIGNED
    fresh = StorageTier(make_storage_config(storage_dir))  # a buffered reader, unaligned buffers
    for k in ks:
        dest = bytearray(size)
        assert fresh.read_into(ns, k, memoryview(dest)) and bytes(dest) == store_payload(k, size)
    store.clear(dram=True)  # a storage hit: promoted with O_DIRECT straight into pool slots
    reads = store.storage.counters.reads
    assert load(store, ns, ks) == [store_payload(k, size) for k in ks]
    assert store.storage.counters.reads == reads + len(ks)


def test_the_setting_is_read_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HPKV_CONFIG_FILE_PATH", str(tmp_path / "none.ini"))
    monkeypatch.setenv("HPKV_KV_STORAGE_DIRECT_IO", "on")
    assert load_settings().storage.direct_io is True
    monkeypatch.delenv("HPKV_KV_STORAGE_DIRECT_IO")
    assert load_settings().storage.direct_io is False


@pytest.mark.parametrize("layout", ["same size", "other size"])
def test_a_file_of_a_newer_format_is_a_miss_left_in_place_for_the_nodes_that_read_it(open_tier, caplog, layout):
    tier = open_tier(direct=False)
    k = key(f"newer {layout}")
    assert write(tier, k)
    path = entry_path(tier, k)
    data = bytearray(path.read_bytes())
    data[8:10] = (fmt.VERSIONS[-1] + 1).to_bytes(2, "little")  # what a later HPKV might write
    if layout == "other size":
        data += b"\0" * 512  # a longer header, say
    path.write_bytes(bytes(data))
    assert tier.contains(NS, k)
    with caplog.at_level(logging.WARNING, logger="hpkv.storage.tier"):
        assert read(tier, k) is None and read(tier, k) is None
    assert path.read_bytes() == bytes(data)  # kept, unchanged
    assert tier.counters.bad_files == 0 and tier.counters.read_misses == 2
    # No longer a hit here (every load of it would miss), nor adopted again from the disk:
    assert not tier.indexed(NS, k) and not tier.contains(NS, k)
    warnings = [r.getMessage() for r in caplog.records if "newer than this HPKV reads" in r.getMessage()]
    assert len(warnings) == 1 and f"file format {fmt.VERSIONS[-1] + 1}" in warnings[0]
