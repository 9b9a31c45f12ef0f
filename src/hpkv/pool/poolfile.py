"""The pool file's place: the pool directory made ready for it (made 0700, on a file system that
can hold the file, trusted as `pool.directory` says, writable), the space checked, and the file
created exclusively under an `flock` held for the owner's life, a dead owner's file removed first.
Why each choice: `pool/region.py`.

Primitives: `prepare_directory` (also the server's, for its socket), `warn_if_not_in_memory`,
`check_space`, `create_exclusive`, `names`.
Must not know: the mapping, slots, entries, the protocol.
"""

from __future__ import annotations

import fcntl
import logging
import os
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

log = logging.getLogger("hpkv.pool.region")  # the start-up messages of the pool, under one name


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


def warn_if_not_in_memory(directory: Path) -> None:
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


def check_space(directory: Path, size_bytes: int) -> None:
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


def create_exclusive(path: Path) -> int:
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
        if names(path, fd):
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
        if names(path, fd):  # still the file we locked, not one created since by a server starting
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


def names(path: Path, fd: int) -> bool:
    """Whether `path` is (still) the file open as `fd` (a link to it is not)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
