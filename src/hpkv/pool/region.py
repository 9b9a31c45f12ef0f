"""The shared-memory region: one file in the pool directory, mapped by every process.

The owner (the HPKV server, or an in-process store) creates the file with `create`; other
processes `attach` to a descriptor of it and copy bytes in and out of the offsets the owner hands
out. Why each choice:
- `O_CREAT|O_EXCL` and an exclusive `flock` held for the owner's lifetime: two owners would hand
  out the same slots; a file whose lock can be taken is a dead owner's, and is replaced.
- The free space is checked at start and the file sized at once; its pages are reserved
  (`posix_fallocate`: a full tmpfs would otherwise kill a writer with SIGBUS mid-copy) and, where
  they could be swapped, locked, by a background thread (`pool.backing`): `ready_bytes` is the
  prefix done, and nothing beyond it may be handed out. A start that waited for every page would
  grow with the pool.
- Handed over as a descriptor (`share_fd()`), never re-opened by name, which someone able to
  write the directory could swap. `share_fd` is a second open file description (through
  /proc/self/fd), so mappings made from it do not share the owner's `flock`: a client that
  outlives a killed server must not make its pool look live. Where the kernel allows, nobody can
  truncate the file through it, and a size changed is set back (`pool.handout`); a file cut
  short all the same is found before a copy (`check_whole`).
- Every open in the pool directory is O_NOFOLLOW|O_NONBLOCK and fstat-checked (`safefs`), and the
  directory itself must be trustworthy (`pool.directory`).
Must not know: slots, entries, the protocol.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from .. import safefs
from ..errors import PoolError
from ..fsinfo import (
    MEMORY_FS,
    PSEUDO_FS,
    cgroup_memory_left,
    existing_ancestor,
    free_bytes,
    meminfo_available_bytes,
    mount_of,
)
from ..units import human_bytes
from . import directory as pool_directory
from . import handout
from .backing import Backing, populate, populate_range, size_file

log = logging.getLogger(__name__)

POOL_FILE_NAME = "hpkv.pool"
MIN_POOL_BYTES = 1 << 20


class PoolRegion:
    """A mapped pool file. Use `create` (owner) or `attach` (any other process, given a
    descriptor of the owner's). `path` is where the owner created it: for messages only."""

    def __init__(self, path: Path, fd: int, size_bytes: int, owner: bool) -> None:
        self.path = path
        self.size_bytes = size_bytes
        self.owner = owner
        self.backing: Backing | None = None  # the owner's: reserves and locks pages in the background
        self._closed = False
        self._fd = fd
        self._shared: handout.Shared | None = None  # the owner's: what it hands out
        self._unshare: Callable[[], object] = lambda: None  # closes it (`create`)
        self._map = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            # Huge pages halve the cost of TLB misses in large copies, and make reserving and
            # locking 512 times fewer faults. Only a tmpfs mounted huge=within_size or huge=always
            # gives them to the pool: shmem_enabled does not apply to a tmpfs mount, and the
            # background posix_fallocate that allocates the pages sees no advice
            # (docs/operations.md).
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        self.buf = memoryview(self._map)
        st = os.fstat(fd)
        self.inode = st.st_ino
        self.identity = (st.st_dev, st.st_ino)  # the file, whatever its name says now

    @classmethod
    def create(cls, directory: Path, size_bytes: int) -> PoolRegion:
        """Create the pool file exclusively, reserve its memory and map it.

        Raises PoolError naming the path and the fix when the directory is unusable, the pool
        does not fit, or a live owner already holds the file.
        """
        if size_bytes < MIN_POOL_BYTES:
            raise PoolError(f"HPKV_KV_MEM_POOL_SIZE={size_bytes} bytes is too small; use at least 1m")
        directory = Path(directory)
        prepare_directory(directory)
        _warn_if_not_in_memory(directory)
        path = directory / POOL_FILE_NAME
        fd = _create_exclusive(path)
        try:
            # Only now: a stale pool left by a crashed owner has been removed and frees its space.
            _check_space(directory, size_bytes)
            size_file(fd, path, size_bytes)
            shared = handout.Shared(fd, path, size_bytes)
            try:
                region = cls(path, fd, size_bytes, owner=True)
            except BaseException:
                shared.close()
                raise
            region._shared, region._unshare = shared, weakref.finalize(region, shared.close)
        except BaseException:
            if _names(path, fd):
                os.unlink(path)
            os.close(fd)
            raise
        region.backing = Backing(fd, region._map, size_bytes, path, mount_of(directory).fs_type)
        region.backing.start()
        shared.ready_bytes = functools.partial(getattr, region.backing, "ready_bytes")
        return region

    @property
    def ready_bytes(self) -> int:
        """The owner's: bytes from the start of the pool with pages reserved (and locked where
        needed); no slot beyond may be handed out. Grows only."""
        return self.backing.ready_bytes if self.backing is not None else self.size_bytes

    @property
    def locked_in_memory(self) -> bool:
        return self.backing is not None and self.backing.locked_in_memory

    def backing_stats(self) -> dict:
        """The `DramStats` fields of the pages behind the pool."""
        b = self.backing
        return {
            "locked_in_memory": self.locked_in_memory,
            "ready_bytes": self.ready_bytes,
            "locked_bytes": b.locked_bytes if b is not None else 0,
            "no_lock_why": b.no_lock_why if b is not None else None,
        }

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Whether every page is reserved (and locked where needed) within `timeout_s`."""
        return self.backing is None or self.backing.wait(timeout_s)

    def share_fd(self) -> int:
        """The owner's descriptor to hand to other processes (SCM_RIGHTS, `pass_fds`); it stays
        the region's: send or pass it, never close it. The file has the pool's size when it is
        handed out: set back if a holder changed it."""
        if self._shared is None or self._closed:
            raise PoolError("only the pool's owner, before it closes, can share the pool file")
        return self._shared.handout()

    @property
    def unguarded(self) -> str | None:
        """Why clients could change the owner's pool file's size; None: they cannot."""
        return self._shared.unguarded if self._shared is not None else None

    def check_whole(self) -> None:
        """PoolError unless the pool file still reaches the end of this mapping: a copy past a
        file's end is a SIGBUS, which kills the process. One `fstat`; narrows the window to the
        copy itself where truncation is not prevented (`pool.handout`)."""
        try:
            size = self._map.size()  # fstat of the map's own descriptor
        except (OSError, ValueError):  # closed: the copy says so itself
            return
        if size < self.size_bytes:
            raise PoolError(
                f"the HPKV pool file {self.path} was cut short ({human_bytes(size)} of "
                f"{human_bytes(self.size_bytes)}); the copy is skipped and its blocks are recomputed"
            )

    @classmethod
    def attach(cls, fd: int, size_bytes: int, path: Path | str) -> PoolRegion:
        """Map the pool file open as `fd` (received from its owner), which must be a regular file
        of at least `size_bytes` (what the owner announced; a holder may have written past its
        end); `path` names it in messages. Takes `fd`: it is closed whatever happens."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < size_bytes:
                what = f"{safefs.kind(st.st_mode)}" if not stat.S_ISREG(st.st_mode) else f"a file of {st.st_size} bytes"
                raise PoolError(
                    f"the descriptor passed for the HPKV pool file {path} is {what}, not the "
                    f"pool of {size_bytes} bytes its server announced; restart the HPKV server"
                )
            try:
                region = cls(Path(path), fd, size_bytes, owner=False)
            except (OSError, ValueError) as exc:
                raise PoolError(f"cannot map the HPKV pool file {path}: {exc}") from None
        finally:
            # The map holds the file open by a descriptor of its own, closed with the map (also
            # when the region is collected unclosed): once a restarted server's old pool file has
            # no mapping left, nothing here keeps its memory.
            os.close(fd)
        region._fd = -1
        return region

    def prefault(self) -> None:
        """Map every page of the pool into this process now, in a background thread, so copies
        into and out of it do not take a page fault per 4 KiB (16,384 faults for a 64 MiB load:
        a third of its time here). Costs page tables, 2 MiB per GiB of pool; best effort."""
        # Holds the region weakly: a pool its clients let go of (a dead server's) is unmapped,
        # not populated on to the end.
        target, args = populate, (weakref.WeakMethod(self._populate_range), self.size_bytes)
        threading.Thread(target=target, args=args, name="hpkv-prefault", daemon=True).start()

    def _populate(self) -> None:
        """What `prefault` runs in its thread."""
        populate(weakref.WeakMethod(self._populate_range), self.size_bytes)

    def _populate_range(self, start: int, length: int) -> bool:
        return not self._closed and populate_range(self._map, start, length)

    def unbacked_bytes(self) -> int:
        """Bytes of the pool file with no pages (or blocks) behind them yet: those the background
        reservation has not reached, and on ramfs, which has no fallocate, all those not touched
        yet (they arrive on first touch; until then the memory available still counts them)."""
        return max(0, self.size_bytes - os.fstat(self._fd).st_blocks * 512)

    def view(self, offset: int, num_bytes: int) -> memoryview:
        return self.buf[offset : offset + num_bytes]

    def close(self) -> None:
        """Unmap; the owner also removes the file (mappings held by others stay valid)."""
        if self._closed:
            return
        self._closed = True
        if self.backing is not None:
            self.backing.stop()  # before the map and descriptor it works on go
            self._unshare()  # its watch too
        self.buf.release()
        try:
            self._map.close()
        except BufferError:
            # Someone still holds a view of the map: leave it to the garbage collector.
            log.debug("pool map still exported; leaving unmap to the collector")
        if self._fd < 0:
            return  # a client's: its descriptor was closed once mapped
        if self.owner and _names(self.path, self._fd):  # not another server's file of the same name
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> PoolRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prepare_directory(directory: Path) -> None:
    """Make the pool directory (0700) if needed; PoolError naming the problem and the fix when it
    cannot hold the pool: a kernel pseudo file system, a file in the way, no write permission, or
    a directory others could replace names in (`pool.directory`)."""
    fs_type = mount_of(directory).fs_type
    if fs_type in PSEUDO_FS:
        raise PoolError(
            f"{directory} (HPKV_SHARE_MEM_FILE_PATH) is on {fs_type}, a kernel pseudo file system "
            "that cannot hold the pool file; point HPKV_SHARE_MEM_FILE_PATH at a directory on ramfs "
            "or tmpfs, e.g. under /dev/shm"
        )
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise PoolError(
            f"cannot create {directory} (HPKV_SHARE_MEM_FILE_PATH): {existing_ancestor(directory)} "
            "is a file, not a directory; point HPKV_SHARE_MEM_FILE_PATH at a directory on ramfs or "
            "tmpfs"
        ) from None
    except OSError as exc:
        raise PoolError(
            f"cannot create the pool directory {directory} (HPKV_SHARE_MEM_FILE_PATH): {exc.strerror}; "
            "create it or point HPKV_SHARE_MEM_FILE_PATH at a writable ramfs/tmpfs directory"
        ) from None
    # Only this uid and root: a server's pool directory is its own (HPKV_SERVER_ALLOW_UIDS names
    # clients; they may use it, not own it).
    pool_directory.check(directory, safefs.owners())
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PoolError(
            f"the pool directory {directory} (HPKV_SHARE_MEM_FILE_PATH) is not writable by "
            f"uid {os.geteuid()}; fix its permissions or choose another directory"
        )


def _warn_if_not_in_memory(directory: Path) -> None:
    mount = mount_of(directory)
    if mount.fs_type not in MEMORY_FS:
        log.warning(
            "the pool directory %s is on %s (%s), not ramfs/tmpfs: pool pages are backed by that file "
            "system and may be written back to disk, which makes copies slow. Fix: mount ramfs "
            "(mount -t ramfs nodev %s) or use a tmpfs directory such as /dev/shm/hpkv-%d",
            directory,
            mount.fs_type,
            mount.mount_point,
            directory,
            os.geteuid(),
        )


def _check_space(directory: Path, size_bytes: int) -> None:
    mount = mount_of(directory)
    # ramfs reports no size at all; the memory it can take is what the machine has free.
    available = meminfo_available_bytes() if mount.fs_type == "ramfs" else free_bytes(directory)
    if size_bytes > available:
        raise PoolError(
            f"the DRAM pool does not fit: HPKV_KV_MEM_POOL_SIZE asks for {human_bytes(size_bytes)} in "
            f"{directory} ({mount.fs_type} at {mount.mount_point}) but only {human_bytes(available)} is free; "
            "lower HPKV_KV_MEM_POOL_SIZE or enlarge the mount"
        )
    # A container's limit only warns: what its cgroup has left moves with its page cache and
    # other processes, and refusing on an estimate stopped pools that fitted.
    left = cgroup_memory_left() if mount.fs_type in MEMORY_FS else None
    if left is not None and size_bytes > left:
        log.warning(
            "the DRAM pool (HPKV_KV_MEM_POOL_SIZE=%s) is more than this container's memory limit leaves "
            "(%s under the memory.max of its cgroup): the pool's pages count against that limit, and the "
            "kernel may kill the server as they fill. Lower HPKV_KV_MEM_POOL_SIZE or raise the container's "
            "memory limit",
            human_bytes(size_bytes),
            human_bytes(left),
        )


def _create_exclusive(path: Path) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    for _ in range(3):
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            _remove_if_stale(path)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another server starting, checking our new file for staleness
            os.close(fd)
            continue
        if _names(path, fd):
            return fd
        os.close(fd)  # another server starting took our new, unlocked file for a stale one: again
    raise PoolError(f"cannot create the pool file {path}: it keeps reappearing; is another server starting?")


def _remove_if_stale(path: Path) -> None:
    try:
        fd = safefs.open_file(path, os.O_RDWR, safefs.owners())
    except FileNotFoundError:
        return
    except PermissionError as exc:
        raise PoolError(_not_ours(path, exc)) from None
    except safefs.UnsafeFile as exc:
        if exc.why.startswith("belongs to"):
            raise PoolError(_not_ours(path, exc)) from None
        raise PoolError(
            f"the pool file {exc}, which HPKV never makes; remove it (rm {path}) or point "
            "HPKV_SHARE_MEM_FILE_PATH at a directory only this user can write to"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise PoolError(
            f"the pool file {path} is owned by a running HPKV process; use that server, or stop it "
            "first, or give this one another HPKV_SHARE_MEM_FILE_PATH (a server whose socket is gone is "
            "stopping: it writes its last entries to storage, removes the pool and exits; engines recompute "
            "meanwhile and start a new server after it)"
        ) from None
    try:
        if _names(path, fd):  # still the file we locked, not one created since by a server starting
            log.warning("removing stale pool file %s left by a process that is gone", path)
            os.unlink(path)
    except PermissionError as exc:  # a sticky directory (a shared ramfs): only its owner may remove it
        raise PoolError(_not_ours(path, exc)) from None
    finally:
        os.close(fd)


def _not_ours(path: Path, exc: OSError | safefs.UnsafeFile) -> str:
    try:
        owner = f"uid {os.lstat(path).st_uid}"
    except OSError:
        owner = "another user"
    why = exc.strerror if isinstance(exc, OSError) else "not this user's file"
    return (
        f"the pool file {path} belongs to {owner} and uid {os.geteuid()} cannot check or replace it "
        f"({why}); if no HPKV server of that user runs, remove it as that user or root "
        f"(rm {path}), or give each user a pool directory of its own in HPKV_SHARE_MEM_FILE_PATH"
    )


def _names(path: Path, fd: int) -> bool:
    """Whether `path` is (still) the file open as `fd` (a link to it is not)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
