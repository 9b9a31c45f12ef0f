"""`hpkv doctor`: checks of this node's setup, each with a verdict and, for a problem, a fix.

Primitives: `Check(name, verdict, detail, fix)`, `Verdict`, `run_checks(env)`. Each check is a
small function of the settings (and of what the running server says, when one answers); none
changes anything on the machine. A `fail` means HPKV cannot work as configured; a `warn` means
it works, worse than it could; `info` is something to know.
Must not know: how checks are shown (the CLI renders them).
"""

from __future__ import annotations

import enum
import json
import os
import resource
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from . import __version__, safefs
from .config import PoolConfig, Settings, StorageConfig, load_settings
from .errors import ConfigError, HpkvError
from .fsinfo import (MEMORY_FS, PSEUDO_FS, cgroup_memory_left, existing_ancestor, free_bytes, meminfo_available_bytes,
                     mount_of, room_bytes)
from .pool import directory as pool_directory
from .pool.region import POOL_FILE_NAME
from .server import protocol as p
from .server.autostart import ServerUnavailable
from .server.client import Client
from .stats import ServerStats
from .storage import root as storage_root
from .storage.fileio import direct_supported
from .storage.tier import AUTO_CAPACITY_FRACTION, SMALL_AUTO_CAPACITY
from .status import human_bytes, human_duration

NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "sshfs", "9p"})
PARALLEL_FS = frozenset({"lustre", "gpfs", "beegfs", "ceph", "cephfs", "fuse.3fs", "fuse.hf3fs", "glusterfs",
                         "fuse.glusterfs", "weka", "wekafs"})
# virtio and Xen disks say "rotational" whatever backs them.
_VIRTUAL_DISKS = ("vd", "xvd")
_CAP_IPC_LOCK = 14
_MAX_SOCKET_PATH_BYTES = 107  # sun_path holds 108 bytes, the last one a NUL


class Verdict(str, enum.Enum):
    OK = "ok"
    INFO = "info"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class ServerProbe:
    """What the node's server said: its stats, or why there are none."""

    socket: Path
    stats: ServerStats | None = None
    error: HpkvError | None = None


def run_checks(env: Mapping[str, str] | None = None) -> list[Check]:
    env = os.environ if env is None else env
    try:
        settings = load_settings(env)
    except ConfigError as exc:
        return [Check("config", Verdict.FAIL, str(exc), "correct that key (see `hpkv config` and "
                      "docs/configuration.md), then run hpkv doctor again")]
    server = probe_server(settings.pool.dir, settings.server_allow_uids)
    checks = check_config(settings)
    checks += [check_pool_fs(settings.pool), check_pool_pages(settings.pool),
               check_pool_permissions(settings.pool, settings.server_allow_uids), check_socket_path(settings.pool),
               check_pool_space(settings.pool), check_memlock(settings.pool, server)]
    checks += check_storage(settings.storage, server, settings.pool)
    checks += [check_server(server), check_hash_seed(env)]
    if server.stats is not None:
        checks.append(check_namespaces(server.stats))
    return checks


def probe_server(directory: Path, trusted_uids: tuple[int, ...] = ()) -> ServerProbe:
    socket_path = Path(directory) / p.SOCKET_NAME
    if not socket_path.exists():
        return ServerProbe(socket_path)
    try:
        with Client(directory, kind="doctor", autostart=False, trusted_uids=trusted_uids) as client:
            return ServerProbe(socket_path, stats=client.stats())
    except HpkvError as exc:
        return ServerProbe(socket_path, error=exc)


# -- configuration --------------------------------------------------------------------------------

def check_config(settings: Settings) -> list[Check]:
    if not settings.warnings:
        source = settings.config_file if settings.config_file.exists() else "none found"
        return [Check("config", Verdict.OK, f"settings resolve without warnings (config file: {source})")]
    return [Check("config", Verdict.WARN, warning, "see `hpkv config` for every key and its source")
            for warning in settings.warnings]


def check_hash_seed(env: Mapping[str, str]) -> Check:
    # vLLM 0.32 (v1/core/kv_cache_utils.py, resolve_none_hash_seed): PYTHONHASHSEED wins when set;
    # otherwise sha256/sha256_cbor chain from a fixed seed and xxhash/xxhash_cbor from random bytes.
    seed = env.get("PYTHONHASHSEED")
    if seed is None:
        return Check("hash stability", Verdict.INFO,
                     "PYTHONHASHSEED is not set here: vLLM's default sha256 block hashes are stable across "
                     "restarts, but with --prefix-caching-hash-algo xxhash (or xxhash_cbor) they are random per "
                     "process and KV saved to storage never hits after a restart",
                     "with xxhash, export PYTHONHASHSEED (one fixed value for every engine sharing the storage "
                     "directory) before starting the engine; with sha256 nothing is needed")
    return Check("hash stability", Verdict.OK,
                 f"PYTHONHASHSEED={seed}: vLLM's block hashes are reproducible across restarts with any hash "
                 "algorithm (every engine sharing one storage directory needs the same value; changing it "
                 "changes every key)")


# -- the pool directory ----------------------------------------------------------------------------

def check_pool_fs(pool: PoolConfig) -> Check:
    name = "pool directory: file system"
    mount = mount_of(pool.dir)
    where = f"{pool.dir} is on {mount.fs_type} ({mount.mount_point})"
    if mount.fs_type in PSEUDO_FS:
        return Check(name, Verdict.FAIL, f"{where}, a kernel pseudo file system that cannot hold the pool file",
                     "point HPKV_SHARE_MEM_FILE_PATH at a directory on ramfs or tmpfs, e.g. under /dev/shm")
    if mount.fs_type == "ramfs":
        return Check(name, Verdict.OK, f"{where}: pages are never swapped")
    if mount.fs_type == "tmpfs":
        return Check(name, Verdict.OK, f"{where}: the server locks the pool in memory so it is not swapped "
                     "(see memlock)")
    return Check(name, Verdict.WARN,
                 f"{where}, not ramfs/tmpfs (HPKV_SHARE_MEM_FILE_PATH): the pool's pages are backed by that file "
                 "system, so they are written back to disk (slow copies) and can be paged out",
                 f"mount ramfs there as root (mount -t ramfs nodev {pool.dir}), or point "
                 "HPKV_SHARE_MEM_FILE_PATH at a directory under /dev/shm")


def check_pool_pages(pool: PoolConfig) -> Check:
    """Huge pages for the pool: on 4 KiB pages, a standalone copy out of the pool after the
    machine had been idle for a moment measured 2-3x slower than the same copy right after
    another (64 MiB: 32-40 ms against 11-13 ms; 14-17 ms on 2 MiB pages; docs/operations.md)."""
    name = "pool directory: page size"
    mount = mount_of(pool.dir)
    huge = mount.huge_pages
    where = f"{pool.dir} is on {mount.fs_type} ({mount.mount_point})"
    if huge is None:
        return Check(name, Verdict.INFO, f"{where}: 4 KiB pages (only a tmpfs can give the pool 2 MiB pages)",
                     "for the fastest copies, a tmpfs mounted with huge=within_size (docs/operations.md)")
    if huge in ("always", "within_size"):
        return Check(name, Verdict.OK, f"{where}, mounted huge={huge}: the pool gets 2 MiB pages")
    return Check(name, Verdict.INFO,
                 f"{where}, mounted huge={huge}: the pool gets 4 KiB pages, so copies out of it after a pause "
                 "pay a page walk per 4 KiB (2-3x slower in a standalone measurement)",
                 f"as root: mkdir -p {pool.dir} && mount -t tmpfs -o size=<pool size + 1g>,huge=within_size,"
                 f"mode=0700 tmpfs {pool.dir} (docs/operations.md)")


def check_pool_permissions(pool: PoolConfig, trusted_uids: tuple[int, ...] = ()) -> Check:
    """What server and engines say of the directory at start (`pool.directory`), and more."""
    name = "pool directory: permissions"
    directory = Path(pool.dir)
    uid = os.geteuid()
    if not directory.exists():
        parent = existing_ancestor(directory)
        if not parent.is_dir():
            return Check(name, Verdict.FAIL, f"{directory} cannot be created: {parent} is a file, not a directory",
                         "point HPKV_SHARE_MEM_FILE_PATH at a directory")
        if os.access(parent, os.W_OK | os.X_OK):
            return Check(name, Verdict.OK, f"{directory} does not exist yet; the server creates it with mode 0700")
        return Check(name, Verdict.FAIL, f"{directory} does not exist and {parent} is not writable by uid {uid}",
                     f"create it as root: mkdir -p {directory} && chown {uid} {directory} && chmod 700 {directory}")
    if not directory.is_dir():
        return Check(name, Verdict.FAIL, f"{directory} exists and is not a directory",
                     "point HPKV_SHARE_MEM_FILE_PATH at a directory")
    found = pool_directory.problem(directory, safefs.owners(trusted_uids))
    if found is not None:
        return Check(name, Verdict.FAIL, f"{found.detail}: the server and the engines refuse it", found.fix)
    st = directory.stat()
    mode = st.st_mode & 0o777
    if st.st_uid not in safefs.owners():
        return Check(name, Verdict.INFO,
                     f"{directory} belongs to uid {st.st_uid}, listed in HPKV_SERVER_ALLOW_UIDS: this user's engines "
                     f"use the server of that uid there, but a server started by uid {uid} refuses it",
                     f"let uid {st.st_uid} run the server (hpkv server, as that user)")
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        return Check(name, Verdict.FAIL, f"{directory} is not writable by uid {uid}",
                     f"as root: chown {uid} {directory} && chmod 700 {directory}, or choose another directory")
    if st.st_mode & stat.S_ISVTX and mode & 0o002:
        return Check(name, Verdict.WARN,
                     f"{directory} has mode 1{mode:03o} (owner uid {st.st_uid}): shared by users, each one's files "
                     "its own, but anyone can create names in it first (a lock or log planted before this user's "
                     "makes the server refuse to start, naming it)",
                     f"a directory of this user's own, e.g. HPKV_SHARE_MEM_FILE_PATH=/dev/shm/hpkv-{uid}")
    if mode & 0o077:
        return Check(name, Verdict.WARN,
                     f"{directory} has mode {mode:04o} (owner uid {st.st_uid}): other users can see the names in it; "
                     "the socket and pool file are 0600, but a 0700 directory is recommended",
                     f"chmod 700 {directory}" if st.st_uid == uid else
                     f"use a directory of your own, e.g. HPKV_SHARE_MEM_FILE_PATH=/dev/shm/hpkv-{uid}")
    return Check(name, Verdict.OK, f"{directory} has mode {mode:04o}, owner uid {st.st_uid}, writable")


def check_socket_path(pool: PoolConfig) -> Check:
    name = "pool directory: socket path"
    path = Path(pool.dir) / p.SOCKET_NAME
    num_bytes = len(os.fsencode(path))
    if num_bytes > _MAX_SOCKET_PATH_BYTES:
        return Check(name, Verdict.FAIL, f"the server socket {path} would be {num_bytes} bytes long; Unix "
                     f"sockets allow {_MAX_SOCKET_PATH_BYTES}, so no server could listen there",
                     f"point HPKV_SHARE_MEM_FILE_PATH at a shorter path, e.g. /dev/shm/hpkv-{os.geteuid()}")
    return Check(name, Verdict.OK, f"{path} ({num_bytes} bytes, the limit is {_MAX_SOCKET_PATH_BYTES})")


def _pool_file_bytes(directory: Path) -> int:
    """Space the current pool file holds: a new server replaces it, so it counts as free."""
    try:
        return os.lstat(directory / POOL_FILE_NAME).st_blocks * 512
    except OSError:
        return 0


def check_pool_space(pool: PoolConfig) -> Check:
    name = "pool directory: free space"
    mount = mount_of(pool.dir)
    held = _pool_file_bytes(Path(pool.dir))
    # ramfs reports no size: what it can take is the machine's available memory (as the pool does).
    available = (meminfo_available_bytes() if mount.fs_type == "ramfs" else free_bytes(pool.dir)) + held
    asked = f"HPKV_KV_MEM_POOL_SIZE={human_bytes(pool.size_bytes)}"
    if pool.size_bytes > available:
        return Check(name, Verdict.FAIL,
                     f"the pool does not fit: {asked} but only {human_bytes(available)} is free on "
                     f"{mount.fs_type} at {mount.mount_point}",
                     f"lower HPKV_KV_MEM_POOL_SIZE to at most {human_bytes(available)}, or enlarge the mount "
                     f"(as root: mount -o remount,size=<size> {mount.mount_point})")
    memory = meminfo_available_bytes() + held
    left = cgroup_memory_left() if mount.fs_type in MEMORY_FS else None
    if left is not None and pool.size_bytes > left + held:  # a warning only, as the server's (`_check_space`)
        return Check(name, Verdict.WARN,
                     f"{asked} is more than this container's memory limit leaves ({human_bytes(left + held)} under "
                     "the memory.max of its cgroup): the pool's pages count against it, and the kernel may kill "
                     "the server as they fill",
                     "lower HPKV_KV_MEM_POOL_SIZE or raise the container's memory limit")
    if mount.fs_type == "tmpfs" and pool.size_bytes > memory:
        return Check(name, Verdict.WARN,
                     f"{asked} fits the tmpfs ({human_bytes(available)} free) but exceeds the memory available "
                     f"({human_bytes(memory)}): the kernel would swap or kill processes",
                     f"lower HPKV_KV_MEM_POOL_SIZE below {human_bytes(memory)}")
    return Check(name, Verdict.OK, f"{asked} fits: {human_bytes(available)} free on {mount.fs_type} at "
                 f"{mount.mount_point}")


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
        if server.stats.dram.locked_in_memory:
            return Check(name, Verdict.OK, f"the running server (pid {pid}) has its pool locked in memory")
        return Check(name, Verdict.WARN, f"the running server (pid {pid}) could not lock its pool in memory: "
                     "it may be swapped", "restart the server with a higher memlock limit (ulimit -l unlimited; "
                     "LimitMEMLOCK=infinity in its systemd unit), or mount ramfs for the pool")
    if _has_cap_ipc_lock():
        return Check(name, Verdict.OK, "this user has CAP_IPC_LOCK: a server started from here can lock any "
                     "pool size")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= pool.size_bytes:
        limit = "unlimited" if soft == resource.RLIM_INFINITY else human_bytes(soft)
        return Check(name, Verdict.OK, f"RLIMIT_MEMLOCK is {limit}: enough to lock the "
                     f"{human_bytes(pool.size_bytes)} pool")
    return Check(name, Verdict.WARN,
                 f"RLIMIT_MEMLOCK is {human_bytes(soft)}, less than the {human_bytes(pool.size_bytes)} pool: a "
                 "server started from here cannot lock it in memory, so it may be swapped",
                 "raise the limit (ulimit -l unlimited, or memlock in /etc/security/limits.conf; "
                 "LimitMEMLOCK=infinity for a systemd unit), or mount ramfs for the pool")


# -- the storage directory -------------------------------------------------------------------------

def check_storage(storage: StorageConfig, server: ServerProbe, pool: PoolConfig | None = None) -> list[Check]:
    if not storage.enabled:
        return [Check("storage directory", Verdict.INFO,
                      "the storage tier is off (HPKV_KV_STORAGE_ENABLE=false): KV lives in DRAM only")]
    checks = [check_storage_permissions(storage)]
    if server.stats is not None and server.stats.storage_unusable:
        checks.append(check_storage_in_use(server.stats))
    if checks[0].verdict is not Verdict.FAIL:
        checks.append(check_storage_writers(storage))
        checks.append(check_storage_fs(storage))
        if checks[-1].verdict is not Verdict.FAIL:
            checks.append(check_storage_space(storage, server, pool))
        if storage.direct_io and Path(storage.path).is_dir():
            checks.append(check_storage_direct_io(storage))
    if server.stats is not None and server.stats.write_backlog is not None:
        checks.append(check_write_backlog(server.stats))
    return checks


BACKLOG_WARN_SHARE = 0.25  # of the pool, pinned by entries waiting for their write-through


def check_write_backlog(stats: ServerStats) -> Check:
    """The running server's entries waiting for their write-through, against its pool (a server
    with a storage tier: `stats.write_backlog` is not None)."""
    name = "storage: write backlog"
    backlog, pool = stats.write_backlog, stats.dram.capacity_bytes
    if backlog is None:
        raise ValueError("check_write_backlog needs the stats of a server with a storage tier")
    share = backlog.bytes / pool if pool else 0.0
    detail = (f"{backlog.entries} entries ({human_bytes(backlog.bytes)}, {share:.0%} of the pool) wait for "
              "their write-through to storage now")
    if backlog.deferred:
        detail += (f", and {backlog.deferred} more wait unpinned (the backlog pins at most half the pool; an "
                   "entry evicted before its turn stays unwritten)")
    if share <= BACKLOG_WARN_SHARE:
        return Check(name, Verdict.OK, detail)
    return Check(name, Verdict.WARN, f"{detail}: each pins its DRAM slot until written, so the storage device "
                 "is behind what the engines save (a burst drains; a backlog that stays or grows leaves less of "
                 "the pool for new KV)",
                 "run hpkv doctor again in a minute; if it has not drained, see docs/operations.md, \"When storage "
                 "does not keep up\" (a faster device, more HPKV_IO_THREADS, a lower HPKV_WRITE_NICE, direct I/O)")


def check_storage_direct_io(storage: StorageConfig) -> Check:
    name = "storage directory: direct I/O"
    if direct_supported(str(storage.path)):
        return Check(name, Verdict.OK, f"{storage.path} takes O_DIRECT: KV files bypass the page cache "
                     "(HPKV_KV_STORAGE_DIRECT_IO=on)")
    return Check(name, Verdict.WARN, f"HPKV_KV_STORAGE_DIRECT_IO=on, but the file system of {storage.path} does "
                 "not take O_DIRECT: KV files go through the page cache",
                 "leave HPKV_KV_STORAGE_DIRECT_IO off here, or put the storage on a file system with direct I/O "
                 "(ext4, xfs, most parallel file systems)")


def check_storage_permissions(storage: StorageConfig) -> Check:
    name = "storage directory: permissions"
    path = Path(storage.path)
    uid = os.geteuid()
    if not path.exists():
        parent = existing_ancestor(path)
        if not parent.is_dir():
            return Check(name, Verdict.FAIL, f"{path} cannot be created: {parent} is a file, not a directory",
                         "point HPKV_KV_STORAGE_PATH at a directory")
        if os.access(parent, os.W_OK | os.X_OK):
            return Check(name, Verdict.OK, f"{path} does not exist yet; the server creates it")
        return Check(name, Verdict.FAIL, f"{path} does not exist and {parent} is not writable by uid {uid}",
                     f"create it: mkdir -p {path} && chown {uid} {path} (as root if needed), or point "
                     "HPKV_KV_STORAGE_PATH elsewhere")
    if not path.is_dir():
        return Check(name, Verdict.FAIL, f"{path} exists and is not a directory",
                     "point HPKV_KV_STORAGE_PATH at a directory")
    if storage_root.read_only(path):
        mount = mount_of(path).mount_point
        return Check(name, Verdict.FAIL, f"{path} is on a read-only mount ({mount}): no KV file can be written "
                     "there, so a server runs with its DRAM tier only",
                     f"remount it read-write (mount -o remount,rw {mount}) or point HPKV_KV_STORAGE_PATH at a "
                     "writable directory")
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        return Check(name, Verdict.FAIL, f"{path} is not readable and writable by uid {uid}, so a server runs with "
                     "its DRAM tier only",
                     f"as root: chown -R {uid} {path}, or point HPKV_KV_STORAGE_PATH elsewhere")
    mode = path.stat().st_mode & 0o777
    if mode & 0o007:
        return Check(name, Verdict.WARN,
                     f"{path} is writable by uid {uid} but has mode {mode:04o}: other users can read the KV "
                     "files, which hold what the model computed from users' prompts",
                     f"chmod 700 {path} (or 750 with a group, for nodes sharing it)")
    return Check(name, Verdict.OK, f"{path} has mode {mode:04o} and is writable by uid {uid}")


def check_storage_in_use(stats: ServerStats) -> Check:
    """The running server could not use its storage directory and runs on DRAM alone."""
    return Check("storage: running server", Verdict.WARN,
                 f"the running server (pid {stats.server.pid}) runs with the DRAM tier only: "
                 f"{stats.storage_unusable}",
                 "fix the storage directory as that says, then restart the server (`hpkv server`; an "
                 "auto-started one restarts once its last engine has exited)")


def check_storage_writers(storage: StorageConfig) -> Check:
    """Whoever can write the storage tree can plant KV files that engines load as their own: its
    root and namespace directories should be writable by this uid alone (root aside)."""
    name = "storage directory: who can write it"
    uid = os.geteuid()
    found = storage_root.foreign_writers(Path(storage.path), uid)
    if found is None:
        return Check(name, Verdict.OK, f"{storage.path} does not exist yet; the server creates it with mode 0700")
    if not found:
        return Check(name, Verdict.OK, f"{storage.path} and its namespace directories are writable by uid {uid} "
                     "alone (and root)")
    shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
    return Check(name, Verdict.WARN,
                 f"{shown}: whoever can write the storage tree can plant KV files that engines here load as "
                 "their own (the files are checksummed, but a writer can compute a checksum too)",
                 f"chmod -R go-w {storage.path} and chown -R {uid} {storage.path} (mode 700; nodes sharing it run "
                 f"HPKV as one uid, or 750 with a group whose members only read); anyone left able to write "
                 f"it is trusted like uid {uid}")


def _rotational(source: str) -> bool | None:
    """Whether the block device behind a mount source spins (None: not a local block device)."""
    if not source.startswith("/dev/"):
        return None
    block = Path("/sys/class/block") / os.path.basename(os.path.realpath(source))
    for queue in (block / "queue", block.resolve().parent / "queue"):  # a disk, or a partition's disk
        try:
            return (queue / "rotational").read_text().strip() == "1"
        except OSError:
            continue
    return None


def check_storage_fs(storage: StorageConfig) -> Check:
    name = "storage directory: file system"
    mount = mount_of(storage.path)
    where = f"{storage.path} is on {mount.fs_type} ({mount.source} at {mount.mount_point})"
    if mount.fs_type in PSEUDO_FS:
        return Check(name, Verdict.FAIL, f"{where}, a kernel pseudo file system that cannot hold KV files",
                     "point HPKV_KV_STORAGE_PATH at an SSD or a parallel file system")
    if mount.fs_type in NETWORK_FS:
        return Check(name, Verdict.WARN, f"{where}: a network file system (NAS) is slow for KV cache files",
                     "point HPKV_KV_STORAGE_PATH at a local SSD or a parallel file system (Lustre, GPFS, 3FS...)")
    if mount.fs_type in ("tmpfs", "ramfs"):
        return Check(name, Verdict.WARN, f"{where}: a memory file system, so storage takes RAM and is lost at "
                     "reboot", "point HPKV_KV_STORAGE_PATH at an SSD or a parallel file system")
    if mount.fs_type in PARALLEL_FS:
        return Check(name, Verdict.OK, f"{where}: a parallel file system (shareable by several nodes)")
    if _rotational(mount.source):
        device = os.path.basename(os.path.realpath(mount.source))
        if device.startswith(_VIRTUAL_DISKS):
            return Check(name, Verdict.INFO, f"{where}: a virtual disk that calls itself rotational, as most do; "
                         "make sure the host backs it with an SSD, not an HDD or NAS")
        return Check(name, Verdict.WARN, f"{where}: a spinning disk (HDD) is slow for KV cache files",
                     "point HPKV_KV_STORAGE_PATH at an SSD or a parallel file system")
    return Check(name, Verdict.OK, where)


def check_storage_space(storage: StorageConfig, server: ServerProbe, pool: PoolConfig | None = None) -> Check:
    name = "storage directory: free space"
    ramfs = mount_of(storage.path).fs_type == "ramfs"
    # A server starting now puts its pool on a memory file system without taking its pages (they
    # come on first touch): the memory available still counts them, and the tier leaves them out
    # (`room_bytes`), as the server does (`PoolRegion.unbacked_bytes`): all but those a pool file
    # already there holds.
    promised = 0
    if ramfs and pool is not None and server.stats is None and mount_of(pool.dir).fs_type in MEMORY_FS:
        promised = max(0, pool.size_bytes - _pool_file_bytes(Path(pool.dir)))
    free = room_bytes(storage.path, promised)
    # A ramfs has no size and says 0 free: the tier takes half the memory available as its room.
    less_pool = f", less the {human_bytes(promised)} DRAM pool" if promised else ""
    room = (f"{human_bytes(free)} of room (half the memory available{less_pool}: a ramfs has no size of its own, "
            "and nothing bounds it but memory)" if ramfs else f"{human_bytes(free)} free")
    running = server.stats.storage if server.stats is not None else None
    ours = running.used_bytes if running is not None else 0
    if storage.capacity_bytes is None:
        share = round(AUTO_CAPACITY_FRACTION * 100)
        estimate = int((free + ours) * AUTO_CAPACITY_FRACTION)
        if running is not None:
            capacity = running.capacity_bytes
            detail = (f"HPKV_KV_STORAGE_SIZE=auto: the running server sized the tier to {human_bytes(capacity)} "
                      f"({share}% of {'half the memory available' if ramfs else 'the space free'} when it started, "
                      f"plus {share}% of what its files took); "
                      f"{room} now")
        else:
            capacity = estimate
            detail = (f"HPKV_KV_STORAGE_SIZE=auto: a server starting now sizes the tier to {human_bytes(capacity)} "
                      f"({share}% of the {room}, plus {share}% of what HPKV's files already take there)")
        if capacity < SMALL_AUTO_CAPACITY:
            fix = ("free memory on this node (then restart the server), set HPKV_KV_STORAGE_SIZE, or point "
                   "HPKV_KV_STORAGE_PATH at an SSD or a parallel file system" if ramfs else
                   "free space on that file system (then restart the server), set HPKV_KV_STORAGE_SIZE, or point "
                   "HPKV_KV_STORAGE_PATH at a larger file system")
            return Check(name, Verdict.WARN, f"{detail}: little room, so KV files are evicted soon after they are "
                         "written (none are written at 0 B)", fix)
        return Check(name, Verdict.OK, detail)
    held = f" plus {human_bytes(ours)} HPKV holds there" if server.stats is not None else ""
    if storage.capacity_bytes > free + ours:
        if ramfs:
            return Check(name, Verdict.WARN,
                         f"HPKV_KV_STORAGE_SIZE={human_bytes(storage.capacity_bytes)} is more than the {room}"
                         f"{held}: KV files on this ramfs may take memory the engines and the pool need",
                         f"lower HPKV_KV_STORAGE_SIZE to at most {human_bytes(free + ours)}, or point "
                         "HPKV_KV_STORAGE_PATH at an SSD or a parallel file system")
        return Check(name, Verdict.WARN,
                     f"HPKV_KV_STORAGE_SIZE={human_bytes(storage.capacity_bytes)} is more than the "
                     f"{room}{held}: writes will meet a full disk and evict early or be dropped",
                     f"lower HPKV_KV_STORAGE_SIZE to at most {human_bytes(free + ours)}, or set it to auto")
    return Check(name, Verdict.OK, f"HPKV_KV_STORAGE_SIZE={human_bytes(storage.capacity_bytes)} fits: "
                 f"{room}{held}")


# -- the server ------------------------------------------------------------------------------------

COLD_LOOKUP_KEYS = 64  # keys a namespace looked up, all missed, before its misses are worth a word
# What makes KV bytes differ, in the words of an engine's settings (the rank is not: ranks of one
# engine have a namespace each by design).
_DESC_FIELDS = {"engine": "engine", "dtype": "KV dtype", "layout": "KV layout", "block_size": "block size",
                "num_layers": "layers", "entry_bytes": "bytes per block", "tp_size": "tensor parallel size",
                "pp_size": "pipeline parallel size", "cp_size": "context parallel size", "extra": "other settings"}


def check_namespaces(stats: ServerStats) -> Check:
    """Why lookups find nothing: a namespace that looked up many keys and hit none, beside another
    of the same model whose KV it cannot use (engines with different settings)."""
    name = "namespaces: hits"
    namespaces = {ns: (json.loads(n.desc), n) for ns, n in stats.namespaces.items()}
    if not namespaces:
        return Check(name, Verdict.INFO, "no engine has registered with the server yet")
    cold = [ns for ns, (_, n) in namespaces.items()
            if n.lookup_keys >= COLD_LOOKUP_KEYS and not n.hit_keys_dram + n.hit_keys_storage]
    mismatches = []
    for ns in cold:
        desc = namespaces[ns][0]
        for other, (other_desc, _) in namespaces.items():
            if other == ns or other_desc["model"] != desc["model"]:
                continue
            fields = _DESC_FIELDS
            if desc.get("pp_size", 1) > 1 and desc.get("pp_size") == other_desc.get("pp_size"):
                # Pipeline stages of one engine: their layers (and so bytes per block) may differ.
                fields = {k: v for k, v in fields.items() if k not in ("num_layers", "entry_bytes")}
            differ = [f"{label} {desc.get(key)!r} here, {other_desc.get(key)!r} there"
                      for key, label in fields.items() if desc.get(key) != other_desc.get(key)]
            if differ:
                mismatches.append(f"namespace {ns[:12]} ({desc['engine']}, {desc['model']}, rank {desc['rank']}) "
                                  f"looked up {namespaces[ns][1].lookup_keys} keys and found none, and namespace "
                                  f"{other[:12]} of the same model differs in {', '.join(differ)}")
                break
    if mismatches:
        return Check(name, Verdict.WARN, "; ".join(mismatches) + ": KV saved under one cannot serve the other",
                     "give every engine serving the model the same settings (those named) to share its KV; HPKV "
                     "keeps KV of different settings apart on purpose, since loading it would give wrong tokens")
    lookups = sum(n.lookup_keys for _, n in namespaces.values())
    hits = sum(n.hit_keys_dram + n.hit_keys_storage for _, n in namespaces.values())
    detail = f"{len(namespaces)} namespaces; {hits} of {lookups} keys looked up were found"
    if cold:
        return Check(name, Verdict.INFO, f"{detail}; {len(cold)} namespaces found none yet (prompts not seen "
                     "before, or saved only since; an engine's DEBUG log says per request what it loaded and why)")
    return Check(name, Verdict.OK, detail)


def check_server(server: ServerProbe) -> Check:
    name = "server"
    if server.stats is not None:
        s = server.stats.server
        mode = "auto-started" if s.auto else "managed"
        detail = (f"pid {s.pid}, version {s.version} (protocol {s.protocol}), up "
                  f"{human_duration(s.uptime_s)}, {mode}, {len(server.stats.clients) - 1} other clients, "
                  f"socket {server.socket}")
        if s.version != __version__:
            return Check(name, Verdict.WARN, f"{detail}; this hpkv is version {__version__}",
                         "restart the server after upgrading, so both sides run the same version")
        return Check(name, Verdict.OK, detail)
    if server.error is None:
        return Check(name, Verdict.INFO, f"no server is running on {server.socket}: the first engine process "
                     "starts one (auto-start), or run `hpkv server`")
    if isinstance(server.error, ServerUnavailable):
        return Check(name, Verdict.WARN, f"a socket exists at {server.socket} but no server answers on it "
                     f"({server.error}): the last server was killed, or it hangs",
                     "nothing to do for a killed server: the next one removes the stale socket and pool file; "
                     "a hung one must be stopped (kill its pid) first")
    return Check(name, Verdict.FAIL, f"the server at {server.socket} refused this client: {server.error}",
                 "follow the server's message above")
