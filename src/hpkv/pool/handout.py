"""The pool file's descriptor that the owner hands to other processes, and its size kept whole.

Whoever holds a writable descriptor of the pool file could `ftruncate` it: every process that maps
it would then die of SIGBUS on its next touch past the new end, and every new client would be
refused a file of the wrong size. Clients must write through their mapping, so they get a
read-write descriptor; what they must not get is the right to change its size. Two parts:
- `reopen`: a second open file description of the pool file (through /proc/self/fd, so it holds
  no `flock` of the owner's), opened by a short-lived thread that Landlock (Linux 6.2 and later,
  ABI 3) denies the truncate right. Landlock decides that right when a file is opened, and it
  stays with the description: `ftruncate` through it, or through any copy passed with
  SCM_RIGHTS or inherited, fails with EACCES in every process, whatever its uid. The owner's own
  descriptor and its other threads keep every right. Where Landlock cannot do this (an older
  kernel, Landlock not enabled, a seccomp filter), the description is a plain one and `reopen`
  says why (`Handout.unguarded`).
- `restore`: writing or `fallocate` past the end still grows the file (no Landlock right covers
  that, and seals exist only on memfds): harmless to every mapping, which ends at the pool's
  size. The owner sets the size back, and reserves again pages a truncation (where it was not
  prevented) took away: before each hand-out, and as soon as inotify reports a change
  (IN_MODIFY comes from writes, truncation and fallocate, never from stores through a mapping,
  so a pool in use is quiet).
`Shared` holds both for the owner: the descriptor and the thread that watches.
Must not know: slots, clients, the protocol.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import PoolError
from ..units import human_bytes

log = logging.getLogger("hpkv.pool.region")

# The Landlock system calls have these numbers on every architecture (added after the tables
# were unified).
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_ACCESS_FS_TRUNCATE = 1 << 14  # ABI 3
PR_SET_NO_NEW_PRIVS = 38
IN_MODIFY = 0x2
IN_NONBLOCK_CLOEXEC = os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class Handout:
    fd: int
    unguarded: str | None  # None: nobody can change the file's size through `fd`; else why they can


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (or it is disabled)."""
    flags = ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION)
    version = _libc().syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0), flags)
    return max(int(version), 0)


class _Refused(OSError):
    """Landlock could not be set up on the thread."""


def _open_without_truncate(path: str) -> int:
    """In the calling thread, for good: deny it truncating any file, then open `path` read-write.
    Run only on a thread of its own that ends afterwards."""
    libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # Landlock's condition without CAP_SYS_ADMIN
        raise _Refused(ctypes.get_errno(), f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
    handled = ctypes.c_uint64(LANDLOCK_ACCESS_FS_TRUNCATE)  # handled, and no rule allows it anywhere
    ruleset = libc.syscall(
        ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), ctypes.byref(handled), ctypes.c_size_t(8), ctypes.c_uint32(0)
    )
    if ruleset < 0:
        raise _Refused(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        if libc.syscall(ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise _Refused(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    return os.open(path, os.O_RDWR | os.O_CLOEXEC)


def _guarded_open(path: str) -> int:
    """`_open_without_truncate` on a thread that ends with it."""
    result: list[int | BaseException] = []

    def run() -> None:
        try:
            result.append(_open_without_truncate(path))
        except BaseException as exc:  # handed to the caller
            result.append(exc)

    thread = threading.Thread(target=run, name="hpkv-pool-handout")
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def reopen(fd: int, path: Path) -> Handout:
    """A second open file description of the file open as `fd`, read-write, without its flock and,
    where the kernel allows, without the right to truncate."""
    proc = f"/proc/self/fd/{fd}"
    unguarded = _why_unguarded()
    share = -1
    try:
        if unguarded is None:
            try:
                share = _guarded_open(proc)
            except _Refused as exc:  # a seccomp filter, say: a plain description, and why
                unguarded = f"Landlock refused it ({exc.strerror})"
        if share < 0:
            share = os.open(proc, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise PoolError(
            f"cannot reopen the pool file {path} through /proc/self/fd to share it: {exc.strerror}; "
            "the HPKV server needs /proc mounted"
        ) from None
    a, b = os.fstat(share), os.fstat(fd)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # not /proc's magic link (a strange /proc)
        os.close(share)
        raise PoolError(f"/proc/self/fd/{fd} is not the pool file {path}; the HPKV server needs a real /proc")
    return Handout(share, unguarded)


def _why_unguarded() -> str | None:
    abi = landlock_abi()
    if abi >= 3:
        return None
    return (
        f"this kernel has no Landlock truncate right (Landlock ABI {abi}: it needs Linux 6.2 or later "
        "with landlock in its lsm= list)"
    )


def restore(fd: int, path: Path, size_bytes: int, ready_bytes: int) -> None:
    """Set the pool file open as `fd` (the owner's) back to `size_bytes` if a holder of its
    descriptor changed it, and reserve again the pages a truncation took from the first
    `ready_bytes` (those the allocator hands out)."""
    size = os.fstat(fd).st_size
    if size == size_bytes:
        return
    log.warning(
        "the pool file %s is %s, not %s: a process that can write it (a client holding its descriptor, "
        "say) changed its size; setting it back",
        path,
        human_bytes(size),
        human_bytes(size_bytes),
    )
    os.ftruncate(fd, size_bytes)
    if size < ready_bytes:
        try:
            os.posix_fallocate(fd, size, ready_bytes - size)
        except OSError as exc:  # ramfs has none (its pages come on first touch); a full mount
            log.debug("pool pages not reserved again from %d: %s", size, exc.strerror)


class Shared:
    """The owner's hand-out of its pool file open as `fd`: the descriptor for others (`handout`),
    and a thread that sets the file's size back as soon as one of them changes it. The owner sets
    `ready_bytes` (the bytes with pages reserved: `PoolRegion.ready_bytes`) once it knows them.
    Close it before `fd`."""

    def __init__(self, fd: int, path: Path, size_bytes: int) -> None:
        share = reopen(fd, path)
        self.fd, self.unguarded = share.fd, share.unguarded
        if share.unguarded:
            log.info("clients of this pool could change its size: %s", share.unguarded)
        self.ready_bytes: Callable[[], int] = lambda: 0
        self._owner, self._path, self._size = fd, path, size_bytes
        try:
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        except OSError:
            os.close(self.fd)
            raise
        self._inotify = _watch(fd)
        self._thread: threading.Thread | None = None
        if self._inotify >= 0:
            self._thread = threading.Thread(target=self._run, name="hpkv-pool-size", daemon=True)
            self._thread.start()

    def handout(self) -> int:
        """The descriptor to send or pass (it stays this object's), the file at its size."""
        self.restore()
        return self.fd

    def restore(self) -> None:
        restore(self._owner, self._path, self._size, self.ready_bytes())

    def close(self) -> None:
        if self.fd < 0:
            return
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            if self._thread is not threading.current_thread():
                self._thread.join()
        for fd in (self._inotify, self._wake_r, self._wake_w, self.fd):
            if fd >= 0:
                os.close(fd)
        self._inotify = self._wake_r = self._wake_w = self.fd = -1

    def _run(self) -> None:
        while True:
            try:
                ready, _, _ = select.select([self._inotify, self._wake_r], [], [])
            except (OSError, ValueError):  # closed under it (by the collector, on this thread)
                return
            if self._wake_r in ready:
                return
            try:
                while os.read(self._inotify, 4096):  # drain: one look covers them all
                    pass
            except BlockingIOError:
                pass
            except OSError:  # closed under it
                return
            try:
                self.restore()
            except OSError as exc:  # never end the watch: the next hand-out tries again
                log.error("cannot set the pool file %s back to its size: %s", self._path, exc.strerror)


def _watch(fd: int) -> int:
    """An inotify descriptor reporting IN_MODIFY of the file open as `fd`; -1 where there is none
    (the per-user limit of inotify instances reached, say: hand-outs still restore the size)."""
    libc = _libc()
    inotify = libc.inotify_init1(IN_NONBLOCK_CLOEXEC)
    if inotify < 0:
        log.debug("no inotify for the pool file: %s", os.strerror(ctypes.get_errno()))
        return -1
    if libc.inotify_add_watch(inotify, f"/proc/self/fd/{fd}".encode(), IN_MODIFY) < 0:
        log.debug("no inotify watch of the pool file: %s", os.strerror(ctypes.get_errno()))
        os.close(inotify)
        return -1
    return inotify
