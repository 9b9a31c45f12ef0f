"""Shared parts of the storage tier's stories (tests/test_storage_*.py): keys and payloads, a tier
opened on a directory (closed after), a small real disk to fill, fault-injecting FileIOs and a
fake clock.

Test modules take the fixtures by assignment (`open_tier = stories.open_tier`)."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from helpers.clock import FakeClock
from helpers.config import make_storage_config
from hpkv.keys import make_key
from hpkv.storage import format as fmt
from hpkv.storage.fileio import FileIO
from hpkv.storage.storage_tier import StorageTier

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

    def _open(
        root: Path = storage_dir,
        capacity: int | None = 64 * file_bytes(),
        io: FileIO | None = None,
        fsync: str = "off",
        cls=StorageTier,
        clock: FakeClock | None = None,
    ) -> StorageTier:
        tier = cls(make_storage_config(root, capacity, fsync), io, **({"clock": clock} if clock else {}))
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
    result = subprocess.run(
        ["mount", "-t", fs_type, "-o", options, fs_type, str(point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a {fs_type} (needs root): {result.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MiB file system to fill up."""
    point = tmp_path / "disk-4m"
    mount_tmpfs(point, "size=4m")
    yield point
    subprocess.run(["umount", "-l", str(point)], check=True)


def age(tier: StorageTier, ages_s: dict[int, float]) -> None:
    """Set the mtimes of key(i)'s files to `ages_s[i]` seconds ago."""
    now = time.time()
    for i, age_s in ages_s.items():
        os.utime(tier.paths.path_of(NS, key(i)), (now - age_s, now - age_s))


def see_sharing(tier: StorageTier, other: StorageTier) -> None:
    """`tier` adopts a file `other` wrote (in OTHER_NS, removed after): it shares its directory."""
    write(other, key("shared"), ns=OTHER_NS)
    assert tier.contains(OTHER_NS, key("shared"))
    tier.remove(OTHER_NS)
    assert tier.evictor.shared


def held_scan() -> type[StorageTier]:
    """A real tier class whose background scan waits at a gate the test opens (`gate.set()`)."""

    class HeldScan(StorageTier):
        gate = threading.Event()

        def _scan(self) -> None:
            self.gate.wait(10)
            super()._scan()

    return HeldScan


class CountedStats(FileIO):
    """Real system calls; counts `stat`s of paths, and runs `on_stat(path)` after the next one."""

    def __init__(self) -> None:
        self.stats = 0
        self.on_stat = None

    def stat_path(self, path, dir_fd=None):
        self.stats += 1
        result = super().stat_path(path, dir_fd)
        hook, self.on_stat = self.on_stat, None
        if hook is not None:
            hook(path)
        return result


class HookedUnlinks(FileIO):
    """Real system calls; runs `on_unlink(path)` just before the next unlink."""

    def __init__(self) -> None:
        self.on_unlink = None

    def unlink(self, path, dir_fd=None):
        hook, self.on_unlink = self.on_unlink, None
        if hook is not None:
            hook(path)
        super().unlink(path, dir_fd)


class FailingIO(FileIO):
    """Real system calls, except the ones the test says should fail."""

    def __init__(
        self, read_errno: int = 0, write_errno: int = 0, short_writes: int = 0, no_space_writes: int = 0
    ) -> None:
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


class RefusedOpens(FileIO):
    """Real opens, but of entry files for reading, refused with `errno` while it is set."""

    def __init__(self) -> None:
        self.errno = 0

    def open(self, path, flags, mode=0o600, dir_fd=None):
        if self.errno and path.endswith(".kv") and not flags & os.O_WRONLY:
            raise OSError(self.errno, os.strerror(self.errno), path)
        return super().open(path, flags, mode, dir_fd)


class RefusedAndCounted(RefusedOpens, CountedStats):
    def __init__(self) -> None:
        RefusedOpens.__init__(self)
        CountedStats.__init__(self)
