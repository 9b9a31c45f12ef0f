"""The pages behind the pool file: reserved, and locked where they could be swapped, off the
critical path.

The owner sizes the pool file at once (`ftruncate`); a background thread then reserves its pages
(`posix_fallocate`) and, only where they could otherwise be swapped, locks them (`mlock`), in
address order, `CHUNK_BYTES` at a time. `ready_bytes` is the prefix done: it only grows, and the
slot allocator hands out no slab beyond it, so no writer touches a page that has none behind it
(on a full tmpfs that would be a SIGBUS mid-copy). Why each choice:
- In the background: reserving costs about half a second per GiB of 4 KiB pages and locking
  more; a server whose start waited for it would take minutes at production sizes.
- Locked only where something can swap (`swap_needs_lock`): with no swap configured, on ramfs,
  or in a cgroup allowed no swap, shmem pages never leave memory, and `mlock` would only fault
  every page in one by one.
- In address order: the allocator hands out the lowest free slab first, so the pool fills from
  the memory that is ready.
A reservation that fails part way (the mount filled up since the start-up check) leaves the
pool at the size it reached, logged with the fix; a lock that fails warns and leaves the rest
unlocked. Must not know: slots, entries, the protocol.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import mmap
import os
import resource
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import PoolError
from ..units import human_bytes

log = logging.getLogger("hpkv.pool.region")

CHUNK_BYTES = 32 << 20
# Done before `start` returns: a pool this small is ready whole as before, and a larger one has
# its first slabs (at most 256 MiB each) ready for the first writes, at a cost that does not grow.
FIRST_BYTES = 256 << 20
CGROUP_ROOT = Path("/sys/fs/cgroup")
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
POPULATE_STEP = 64 << 20


def swap_needs_lock(fs_type: str) -> str | None:
    """None when pool pages on `fs_type` could be swapped out (lock them); else why they cannot."""
    if fs_type in ("ramfs", "hugetlbfs"):
        return f"{fs_type} pages are never swapped"
    try:
        with open("/proc/swaps", encoding="ascii") as f:
            if len(f.read().strip().splitlines()) <= 1:  # the header alone
                return "no swap is configured"
    except OSError:
        pass
    if _cgroup_swap_max() == "0":
        return "this cgroup may not swap (memory.swap.max is 0)"
    return None


def _cgroup_swap_max() -> str | None:
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            line = next((x for x in f if x.startswith("0::")), "")
        return (CGROUP_ROOT / line.strip()[3:].lstrip("/") / "memory.swap.max").read_text().strip()
    except OSError:
        return None


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, found once (`find_library` runs ldconfig)."""
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def populate(populate_range: Callable[[], Callable[[int, int], bool] | None], size_bytes: int) -> None:
    """Map every page of a pool mapping into this process, POPULATE_STEP at a time, through
    `populate_range()` (a weak method: None once its region is gone), until it says to stop."""
    for start in range(0, size_bytes, POPULATE_STEP):
        step = populate_range()
        if step is None or not step(start, min(POPULATE_STEP, size_bytes - start)):
            return
        del step  # no hold on the region between steps


def populate_range(buf: mmap.mmap, start: int, length: int) -> bool:
    """MADV_POPULATE_WRITE over [start, start + length) of `buf`, the GIL released (`mmap.madvise`
    holds it, for tens of milliseconds a step on 4 KiB pages: an engine's other threads would
    stall). False where it failed (an older kernel, the pool closed, its mount full)."""
    libc = _libc()
    try:
        address = ctypes.c_void_p.from_buffer(buf)
    except (ValueError, TypeError):  # closed
        return False
    try:
        result = libc.madvise(
            ctypes.c_void_p(ctypes.addressof(address) + start), ctypes.c_size_t(length), MADV_POPULATE_WRITE
        )
    finally:
        del address
    if result != 0:
        log.debug("pool prefault stopped at %d: %s", start, os.strerror(ctypes.get_errno()))
    return result == 0


def size_file(fd: int, path: Path, size_bytes: int) -> None:
    """Give the pool file its size, with no pages behind it yet (`Backing` reserves them)."""
    try:
        os.ftruncate(fd, size_bytes)
    except OSError as exc:
        raise PoolError(
            f"cannot size the pool file {path} to {human_bytes(size_bytes)}: {exc.strerror}; lower "
            "HPKV_KV_MEM_POOL_SIZE or free space on that mount"
        ) from None


class Backing:
    """Reserves and locks the pages of a mapped pool file in the background (`start`); stop it
    (`stop`) before the file's descriptor or map goes."""

    def __init__(self, fd: int, buf: mmap.mmap, size_bytes: int, path: Path, fs_type: str) -> None:
        self.size_bytes = size_bytes
        self.ready_bytes = 0  # reserved (and locked, where needed) from the start of the pool
        self.locked_bytes = 0  # that cannot be swapped out: locked, or where nothing swaps
        self.started_at = time.monotonic()
        self.done_s: float | None = None  # how long the whole pool took, once done
        self.no_lock_why = swap_needs_lock(fs_type)
        self._lock = self.no_lock_why is None
        self._fd, self._buf, self._path = fd, buf, path
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpkv-pool-backing", daemon=True)

    @property
    def locked_in_memory(self) -> bool:
        return self.locked_bytes >= self.size_bytes

    def start(self) -> None:
        """Do the first FIRST_BYTES now, the rest in the background."""
        while self.ready_bytes < min(FIRST_BYTES, self.size_bytes):
            if not self._step():
                self._done.set()
                return
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the whole pool is done (or stopped where it failed) within `timeout_s`."""
        return self._done.wait(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        try:
            while self.ready_bytes < self.size_bytes and not self._stop.is_set():
                if not self._step():
                    return
            if self.ready_bytes >= self.size_bytes:
                self.done_s = time.monotonic() - self.started_at
                log.info(
                    "pool of %s ready in %.1f s; %s locked in memory%s",
                    human_bytes(self.size_bytes),
                    self.done_s,
                    human_bytes(self.locked_bytes),
                    f" (no lock needed: {self.no_lock_why})" if self.no_lock_why else "",
                )
        finally:
            self._done.set()

    def _step(self) -> bool:
        """Reserve (and lock) the next chunk; False where reserving stopped."""
        start = self.ready_bytes
        length = min(CHUNK_BYTES, self.size_bytes - start)
        if not self._reserve(start, length):
            return False
        locked = self._lock and self._mlock(start, length)
        self._lock = locked  # after a failure the rest stays unlocked: warned once
        if locked or self.no_lock_why is not None:
            self.locked_bytes = start + length
        self.ready_bytes = start + length  # last: the allocator may hand this out now
        return True

    def _reserve(self, start: int, length: int) -> bool:
        try:
            os.posix_fallocate(self._fd, start, length)
            return True
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                # ramfs has no fallocate: its pages are allocated on first touch, all of them ready.
                self.locked_bytes = self.ready_bytes = self.size_bytes
                return False
            if not self._stop.is_set():
                log.error(
                    "cannot reserve the pool file %s beyond %s of %s: %s; the pool serves that much "
                    "only. Fix: free space on its mount, or lower HPKV_KV_MEM_POOL_SIZE, then restart "
                    "the server",
                    self._path,
                    human_bytes(start),
                    human_bytes(self.size_bytes),
                    exc.strerror,
                )
            return False

    def _mlock(self, start: int, length: int) -> bool:
        libc = _libc()
        address = ctypes.c_void_p.from_buffer(self._buf)
        try:
            result = libc.mlock(ctypes.c_void_p(ctypes.addressof(address) + start), ctypes.c_size_t(length))
        finally:
            del address
        if result == 0:
            return True
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else human_bytes(soft)
        log.warning(
            "cannot lock the %s pool in memory (%s; RLIMIT_MEMLOCK is %s): it may be swapped. "
            "Fix: raise the memlock limit (ulimit -l unlimited, LimitMEMLOCK=infinity) or mount ramfs",
            human_bytes(self.size_bytes),
            os.strerror(ctypes.get_errno()),
            limit,
        )
        return False
