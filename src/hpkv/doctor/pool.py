"""`hpkv doctor`'s checks of the pool directory: its file system, page size, permissions, socket
path, free space, and whether the pool can be locked in memory.

Primitives: `check_pool_fs`, `check_pool_pages`, `check_pool_permissions`, `check_pool_sharing`,
`check_socket_path`, `check_pool_space`, `check_memlock`, and `pool_file_bytes` (what a pool file
there holds).
Must not know: the storage directory.
"""

from __future__ import annotations

import os
import resource
import stat
from pathlib import Path

from .. import safefs
from ..config import PoolConfig
from ..fsinfo import (
    MEMORY_FS,
    PSEUDO_FS,
    cgroup_memory_left,
    existing_ancestor,
    free_bytes,
    meminfo_available_bytes,
    mount_of,
)
from ..pool import directory as pool_directory
from ..pool import handout
from ..pool.region import POOL_FILE_NAME
from ..server import protocol as p
from ..status import human_bytes
from .check import Check, ServerProbe, Verdict

_CAP_IPC_LOCK = 14


_MAX_SOCKET_PATH_BYTES = 107  # sun_path holds 108 bytes, the last one a NUL


def check_pool_fs(pool: PoolConfig) -> Check:
    name = "pool directory: file system"
    mount = mount_of(pool.dir)
    where = f"{pool.dir} is on {mount.fs_type} ({mount.mount_point})"
    if mount.fs_type in PSEUDO_FS:
        return Check(
            name,
            Verdict.FAIL,
            f"{where}, a kernel pseudo file system that cannot hold the pool file",
            "point HPKV_SHARE_MEM_FILE_PATH at a directory on ramfs or tmpfs, e.g. under /dev/shm",
        )
    if mount.fs_type == "ramfs":
        return Check(name, Verdict.OK, f"{where}: pages are never swapped")
    if mount.fs_type == "tmpfs":
        return Check(
            name, Verdict.OK, f"{where}: the server locks the pool in memory so it is not swapped (see memlock)"
        )
    return Check(
        name,
        Verdict.WARN,
        f"{where}, not ramfs/tmpfs (HPKV_SHARE_MEM_FILE_PATH): the pool's pages are backed by that file "
        "system, so they are written back to disk (slow copies) and can be paged out",
        f"mount ramfs there as root (mount -t ramfs nodev {pool.dir}), or point "
        "HPKV_SHARE_MEM_FILE_PATH at a directory under /dev/shm",
    )


def check_pool_pages(pool: PoolConfig) -> Check:
    """Huge pages for the pool: on 4 KiB pages a copy out of an idle pool is slower than on huge
    pages (docs/operations.md, "Huge pages for the pool")."""
    name = "pool directory: page size"
    mount = mount_of(pool.dir)
    huge = mount.huge_pages
    where = f"{pool.dir} is on {mount.fs_type} ({mount.mount_point})"
    mount_it = (
        f"as root: mkdir -p {pool.dir} && mount -t tmpfs -o size=<pool size + 1g>,huge=within_size,"
        f"mode=0700 tmpfs {pool.dir} (docs/operations.md)"
    )
    if huge is None:
        return Check(
            name,
            Verdict.INFO,
            f"{where}: 4 KiB pages (only a tmpfs can give the pool 2 MiB pages), so reserving the pool "
            "in the background after start takes about 0.5 s per GiB, and copies pay a page walk per 4 KiB",
            f"for the fastest copies and a pool ready in seconds at any size, {mount_it}",
        )
    if huge in ("always", "within_size"):
        return Check(name, Verdict.OK, f"{where}, mounted huge={huge}: the pool gets 2 MiB pages")
    return Check(
        name,
        Verdict.INFO,
        f"{where}, mounted huge={huge}: the pool gets 4 KiB pages, so copies out of it after a pause "
        "pay a page walk per 4 KiB (2-3x slower in a standalone measurement)",
        mount_it,
    )


def check_pool_permissions(pool: PoolConfig, trusted_uids: tuple[int, ...] = ()) -> Check:
    """What server and engines say of the directory at start (`pool.directory`), and more."""
    name = "pool directory: permissions"
    directory = Path(pool.dir)
    uid = os.geteuid()
    if not directory.exists():
        parent = existing_ancestor(directory)
        if not parent.is_dir():
            return Check(
                name,
                Verdict.FAIL,
                f"{directory} cannot be created: {parent} is a file, not a directory",
                "point HPKV_SHARE_MEM_FILE_PATH at a directory",
            )
        if os.access(parent, os.W_OK | os.X_OK):
            return Check(name, Verdict.OK, f"{directory} does not exist yet; the server creates it with mode 0700")
        return Check(
            name,
            Verdict.FAIL,
            f"{directory} does not exist and {parent} is not writable by uid {uid}",
            f"create it as root: mkdir -p {directory} && chown {uid} {directory} && chmod 700 {directory}",
        )
    if not directory.is_dir():
        return Check(
            name,
            Verdict.FAIL,
            f"{directory} exists and is not a directory",
            "point HPKV_SHARE_MEM_FILE_PATH at a directory",
        )
    found = pool_directory.problem(directory, safefs.owners(trusted_uids))
    if found is not None:
        return Check(name, Verdict.FAIL, f"{found.detail}: the server and the engines refuse it", found.fix)
    st = directory.stat()
    mode = st.st_mode & 0o777
    if st.st_uid not in safefs.owners():
        return Check(
            name,
            Verdict.INFO,
            f"{directory} belongs to uid {st.st_uid}, listed in HPKV_SERVER_ALLOW_UIDS: this user's engines "
            f"use the server of that uid there, but a server started by uid {uid} refuses it",
            f"let uid {st.st_uid} run the server (hpkv server, as that user)",
        )
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        return Check(
            name,
            Verdict.FAIL,
            f"{directory} is not writable by uid {uid}",
            f"as root: chown {uid} {directory} && chmod 700 {directory}, or choose another directory",
        )
    if st.st_mode & stat.S_ISVTX and mode & 0o002:
        return Check(
            name,
            Verdict.WARN,
            f"{directory} has mode 1{mode:03o} (owner uid {st.st_uid}): shared by users, each one's files "
            "its own, but anyone can create names in it first (a lock or log planted before this user's "
            "makes the server refuse to start, naming it)",
            f"a directory of this user's own, e.g. HPKV_SHARE_MEM_FILE_PATH=/dev/shm/hpkv-{uid}",
        )
    if mode & 0o077:
        return Check(
            name,
            Verdict.WARN,
            f"{directory} has mode {mode:04o} (owner uid {st.st_uid}): other users can see the names in it; "
            "the socket and pool file are 0600, but a 0700 directory is recommended",
            f"chmod 700 {directory}"
            if st.st_uid == uid
            else f"use a directory of your own, e.g. HPKV_SHARE_MEM_FILE_PATH=/dev/shm/hpkv-{uid}",
        )
    return Check(name, Verdict.OK, f"{directory} has mode {mode:04o}, owner uid {st.st_uid}, writable")


def check_pool_sharing(pool: PoolConfig, trusted_uids: tuple[int, ...]) -> Check:
    """Whether the uids of HPKV_SERVER_ALLOW_UIDS, handed the pool's descriptor, could make
    another user's engine die of SIGBUS (docs/operations.md, "The pool's size")."""
    name = "pool directory: other uids"
    uids = ",".join(map(str, trusted_uids))
    abi = handout.landlock_abi()
    if abi < 3:
        return Check(
            name,
            Verdict.WARN,
            f"HPKV_SERVER_ALLOW_UIDS={uids} are handed a pool descriptor they can truncate: this kernel has no "
            f"Landlock truncate right (ABI {abi}), so one of them can kill another's engine mid-copy (SIGBUS)",
            "run the node on Linux 6.2 or later with landlock in the kernel's lsm= list, or admit only uids "
            "that trust each other",
        )
    fs_type = mount_of(pool.dir).fs_type
    if fs_type != "ramfs":
        return Check(
            name,
            Verdict.WARN,
            f"HPKV_SERVER_ALLOW_UIDS={uids} cannot truncate the pool (Landlock ABI {abi}), but on {fs_type} they "
            "can punch holes in it, and a hole touched while the mount is full kills that engine (SIGBUS)",
            f"put the pool on ramfs (as root: mount -t ramfs nodev {pool.dir}; chown it to the server's user)",
        )
    return Check(
        name,
        Verdict.OK,
        f"HPKV_SERVER_ALLOW_UIDS={uids} cannot change the pool's size (Landlock ABI {abi}) nor punch holes (ramfs)",
    )


def check_socket_path(pool: PoolConfig) -> Check:
    name = "pool directory: socket path"
    path = Path(pool.dir) / p.SOCKET_NAME
    num_bytes = len(os.fsencode(path))
    if num_bytes > _MAX_SOCKET_PATH_BYTES:
        return Check(
            name,
            Verdict.FAIL,
            f"the server socket {path} would be {num_bytes} bytes long; Unix "
            f"sockets allow {_MAX_SOCKET_PATH_BYTES}, so no server could listen there",
            f"point HPKV_SHARE_MEM_FILE_PATH at a shorter path, e.g. /dev/shm/hpkv-{os.geteuid()}",
        )
    return Check(name, Verdict.OK, f"{path} ({num_bytes} bytes, the limit is {_MAX_SOCKET_PATH_BYTES})")


def pool_file_bytes(directory: Path) -> int:
    """Space the current pool file holds: a new server replaces it, so it counts as free."""
    try:
        return os.lstat(directory / POOL_FILE_NAME).st_blocks * 512
    except OSError:
        return 0


def check_pool_space(pool: PoolConfig) -> Check:
    name = "pool directory: free space"
    mount = mount_of(pool.dir)
    held = pool_file_bytes(Path(pool.dir))
    # ramfs reports no size: what it can take is the machine's available memory (as the pool does).
    available = (meminfo_available_bytes() if mount.fs_type == "ramfs" else free_bytes(pool.dir)) + held
    asked = f"HPKV_KV_MEM_POOL_SIZE={human_bytes(pool.size_bytes)}"
    if pool.size_bytes > available:
        return Check(
            name,
            Verdict.FAIL,
            f"the pool does not fit: {asked} but only {human_bytes(available)} is free on "
            f"{mount.fs_type} at {mount.mount_point}",
            f"lower HPKV_KV_MEM_POOL_SIZE to at most {human_bytes(available)}, or enlarge the mount "
            f"(as root: mount -o remount,size=<size> {mount.mount_point})",
        )
    memory = meminfo_available_bytes() + held
    left = cgroup_memory_left() if mount.fs_type in MEMORY_FS else None
    if left is not None and pool.size_bytes > left + held:  # a warning only, as the server's (`poolfile.check_space`)
        return Check(
            name,
            Verdict.WARN,
            f"{asked} is more than this container's memory limit leaves ({human_bytes(left + held)} under "
            "the memory.max of its cgroup): the pool's pages count against it, and the kernel may kill "
            "the server as they fill",
            "lower HPKV_KV_MEM_POOL_SIZE or raise the container's memory limit",
        )
    if mount.fs_type == "tmpfs" and pool.size_bytes > memory:
        return Check(
            name,
            Verdict.WARN,
            f"{asked} fits the tmpfs ({human_bytes(available)} free) but exceeds the memory available "
            f"({human_bytes(memory)}): the kernel would swap or kill processes",
            f"lower HPKV_KV_MEM_POOL_SIZE below {human_bytes(memory)}",
        )
    return Check(
        name, Verdict.OK, f"{asked} fits: {human_bytes(available)} free on {mount.fs_type} at {mount.mount_point}"
    )


def _has_cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


def check_memlock(pool: PoolConfig, server: ServerProbe) -> Check:
    name = "memlock"
    if mount_of(pool.dir).fs_type == "ramfs":
        return Check(name, Verdict.OK, "not needed: the pool is on ramfs, whose pages are never swapped")
    if server.stats is not None:
        pid = server.stats.server.pid
        dram = server.stats.dram
        if dram.no_lock_why:
            return Check(name, Verdict.OK, f"not needed: {dram.no_lock_why}, so the pool is never swapped")
        if dram.locked_in_memory:
            return Check(name, Verdict.OK, f"the running server (pid {pid}) has its pool locked in memory")
        if dram.locked_bytes >= dram.ready_bytes:
            return Check(
                name, Verdict.OK, f"the running server (pid {pid}) is locking its pool in memory, in the background"
            )
        return Check(
            name,
            Verdict.WARN,
            f"the running server (pid {pid}) could not lock its pool in memory: it may be swapped",
            "restart the server with a higher memlock limit (ulimit -l unlimited; "
            "LimitMEMLOCK=infinity in its systemd unit), or mount ramfs for the pool",
        )
    if _has_cap_ipc_lock():
        return Check(name, Verdict.OK, "this user has CAP_IPC_LOCK: a server started from here can lock any pool size")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= pool.size_bytes:
        limit = "unlimited" if soft == resource.RLIM_INFINITY else human_bytes(soft)
        return Check(
            name, Verdict.OK, f"RLIMIT_MEMLOCK is {limit}: enough to lock the {human_bytes(pool.size_bytes)} pool"
        )
    return Check(
        name,
        Verdict.WARN,
        f"RLIMIT_MEMLOCK is {human_bytes(soft)}, less than the {human_bytes(pool.size_bytes)} pool: a "
        "server started from here cannot lock it in memory, so it may be swapped",
        "raise the limit (ulimit -l unlimited, or memlock in /etc/security/limits.conf; "
        "LimitMEMLOCK=infinity for a systemd unit), or mount ramfs for the pool",
    )
