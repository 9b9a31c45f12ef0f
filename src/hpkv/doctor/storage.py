"""`hpkv doctor`'s checks of the storage directory: permissions, who can write it, its file system,
free space against the tier's capacity, direct I/O, and the running server's use of it.

Primitives: `check_storage(storage, probe, pool)` (all of them, in order), and each check alone.
Must not know: the pool directory beyond what a pool file there takes (`pool_file_bytes`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import PoolConfig, StorageConfig
from ..fsinfo import MEMORY_FS, PSEUDO_FS, existing_ancestor, mount_of, room_bytes
from ..stats import ServerStats
from ..status import human_bytes
from ..storage import root as storage_root
from ..storage.capacity import AUTO_CAPACITY_FRACTION, auto_capacity_bytes, little_room
from ..storage.fileio import direct_supported
from .check import Check, ServerProbe, Verdict
from .pool import pool_file_bytes
from .shared import check_shared_storage
from .storage_cluster import check_storage_cluster

NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse.sshfs", "sshfs", "9p"})


PARALLEL_FS = frozenset(
    {
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "cephfs",
        "fuse.3fs",
        "fuse.hf3fs",
        "glusterfs",
        "fuse.glusterfs",
        "weka",
        "wekafs",
    }
)


# virtio and Xen disks say "rotational" whatever backs them.
_VIRTUAL_DISKS = ("vd", "xvd")


def check_storage(storage: StorageConfig, server: ServerProbe, pool: PoolConfig | None = None) -> list[Check]:
    if not storage.enabled:
        return [
            Check(
                "storage directory",
                Verdict.INFO,
                "the storage tier is off (HPKV_KV_STORAGE_ENABLE=false): KV lives in DRAM only",
            )
        ]
    checks = [check_storage_permissions(storage)]
    if server.stats is not None and server.stats.storage_unusable:
        checks.append(check_storage_in_use(server.stats))
    if server.stats is not None and server.stats.storage is not None and server.stats.storage.root_replaced:
        checks.append(check_storage_replaced(server.stats))
    if checks[0].verdict is not Verdict.FAIL:
        checks.append(check_storage_writers(storage))
        checks.append(check_storage_fs(storage))
        checks.extend(check_shared_storage(storage))
        checks.extend(check_storage_cluster(storage, server))
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
    detail = (
        f"{backlog.entries} entries ({human_bytes(backlog.bytes)}, {share:.0%} of the pool) wait for "
        "their write-through to storage now"
    )
    if backlog.deferred:
        detail += (
            f", and {backlog.deferred} more wait unpinned (the backlog pins at most half the pool; an "
            "entry evicted before its turn stays unwritten)"
        )
    if share <= BACKLOG_WARN_SHARE:
        return Check(name, Verdict.OK, detail)
    return Check(
        name,
        Verdict.WARN,
        f"{detail}: each pins its DRAM slot until written, so the storage device "
        "is behind what the engines save (a burst drains; a backlog that stays or grows leaves less of "
        "the pool for new KV)",
        'run hpkv doctor again in a minute; if it has not drained, see docs/operations.md, "When storage '
        'does not keep up" (a faster device, more HPKV_IO_THREADS, a lower HPKV_WRITE_NICE, direct I/O)',
    )


def check_storage_direct_io(storage: StorageConfig) -> Check:
    name = "storage directory: direct I/O"
    if direct_supported(str(storage.path)):
        return Check(
            name,
            Verdict.OK,
            f"{storage.path} takes O_DIRECT: KV files bypass the page cache (HPKV_KV_STORAGE_DIRECT_IO=on)",
        )
    return Check(
        name,
        Verdict.WARN,
        f"HPKV_KV_STORAGE_DIRECT_IO=on, but the file system of {storage.path} does "
        "not take O_DIRECT: KV files go through the page cache",
        "leave HPKV_KV_STORAGE_DIRECT_IO off here, or put the storage on a file system with direct I/O "
        "(ext4, xfs, most parallel file systems)",
    )


def check_storage_permissions(storage: StorageConfig) -> Check:
    name = "storage directory: permissions"
    path = Path(storage.path)
    uid = os.geteuid()
    if not path.exists():
        parent = existing_ancestor(path)
        if not parent.is_dir():
            return Check(
                name,
                Verdict.FAIL,
                f"{path} cannot be created: {parent} is a file, not a directory",
                "point HPKV_KV_STORAGE_PATH at a directory",
            )
        if os.access(parent, os.W_OK | os.X_OK):
            return Check(name, Verdict.OK, f"{path} does not exist yet; the server creates it")
        return Check(
            name,
            Verdict.FAIL,
            f"{path} does not exist and {parent} is not writable by uid {uid}",
            f"create it: mkdir -p {path} && chown {uid} {path} (as root if needed), or point "
            "HPKV_KV_STORAGE_PATH elsewhere",
        )
    if not path.is_dir():
        return Check(
            name, Verdict.FAIL, f"{path} exists and is not a directory", "point HPKV_KV_STORAGE_PATH at a directory"
        )
    if storage_root.read_only(path):
        mount = mount_of(path).mount_point
        return Check(
            name,
            Verdict.FAIL,
            f"{path} is on a read-only mount ({mount}): no KV file can be written "
            "there, so a server runs with its DRAM tier only",
            f"remount it read-write (mount -o remount,rw {mount}) or point HPKV_KV_STORAGE_PATH at a "
            "writable directory",
        )
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        return Check(
            name,
            Verdict.FAIL,
            f"{path} is not readable and writable by uid {uid}, so a server runs with its DRAM tier only",
            f"as root: chown -R {uid} {path}, or point HPKV_KV_STORAGE_PATH elsewhere",
        )
    mode = path.stat().st_mode & 0o777
    if mode & 0o007:
        return Check(
            name,
            Verdict.WARN,
            f"{path} is writable by uid {uid} but has mode {mode:04o}: other users can read the KV "
            "files, which hold what the model computed from users' prompts",
            f"chmod 700 {path} (or 750 with a group, for nodes sharing it)",
        )
    return Check(name, Verdict.OK, f"{path} has mode {mode:04o} and is writable by uid {uid}")


def check_storage_in_use(stats: ServerStats) -> Check:
    """The running server could not use its storage directory and runs on DRAM alone."""
    return Check(
        "storage: running server",
        Verdict.WARN,
        f"the running server (pid {stats.server.pid}) runs with the DRAM tier only: {stats.storage_unusable}",
        "fix the storage directory as that says, then restart the server (`hpkv server`; an "
        "auto-started one restarts once its last engine has exited)",
    )


def check_storage_replaced(stats: ServerStats) -> Check:
    """The running server's storage directory was moved away under it: it goes on with the one it
    opened, and follows nothing at the name."""
    assert stats.storage is not None and stats.storage.root_replaced
    return Check(
        "storage: running server",
        Verdict.WARN,
        f"the running server (pid {stats.server.pid}): {stats.storage.root_replaced}",
        "put the directory back, or restart the server to use what its name holds now",
    )


def check_storage_writers(storage: StorageConfig) -> Check:
    """Whoever can write the storage tree can plant KV files that engines load as their own: its
    root and namespace directories should be writable by this uid alone (root aside)."""
    name = "storage directory: who can write it"
    uid = os.geteuid()
    found = storage_root.foreign_writers(Path(storage.path), uid)
    if found is None:
        return Check(name, Verdict.OK, f"{storage.path} does not exist yet; the server creates it with mode 0700")
    if not found:
        return Check(
            name, Verdict.OK, f"{storage.path} and its namespace directories are writable by uid {uid} alone (and root)"
        )
    shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
    return Check(
        name,
        Verdict.WARN,
        f"{shown}: whoever can write the storage tree can plant KV files that engines here load as "
        "their own (the files are checksummed, but a writer can compute a checksum too)",
        f"chmod -R go-w {storage.path} and chown -R {uid} {storage.path} (mode 700; nodes sharing it run "
        f"HPKV as one uid, or 750 with a group whose members only read); anyone left able to write "
        f"it is trusted like uid {uid}",
    )


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
        return Check(
            name,
            Verdict.FAIL,
            f"{where}, a kernel pseudo file system that cannot hold KV files",
            "point HPKV_KV_STORAGE_PATH at an SSD or a parallel file system",
        )
    if mount.fs_type in NETWORK_FS:
        return Check(
            name,
            Verdict.WARN,
            f"{where}: a network file system (NAS) is slow for KV cache files",
            "point HPKV_KV_STORAGE_PATH at a local SSD or a parallel file system (Lustre, GPFS, 3FS...)",
        )
    if mount.fs_type in ("tmpfs", "ramfs"):
        return Check(
            name,
            Verdict.WARN,
            f"{where}: a memory file system, so storage takes RAM and is lost at reboot",
            "point HPKV_KV_STORAGE_PATH at an SSD or a parallel file system",
        )
    if mount.fs_type in PARALLEL_FS:
        return Check(name, Verdict.OK, f"{where}: a parallel file system (shareable by several nodes)")
    if _rotational(mount.source):
        device = os.path.basename(os.path.realpath(mount.source))
        if device.startswith(_VIRTUAL_DISKS):
            return Check(
                name,
                Verdict.INFO,
                f"{where}: a virtual disk that calls itself rotational, as most do; "
                "make sure the host backs it with an SSD, not an HDD or NAS",
            )
        return Check(
            name,
            Verdict.WARN,
            f"{where}: a spinning disk (HDD) is slow for KV cache files",
            "point HPKV_KV_STORAGE_PATH at an SSD or a parallel file system",
        )
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
        promised = max(0, pool.size_bytes - pool_file_bytes(Path(pool.dir)))
    free = room_bytes(storage.path, promised)
    # A ramfs has no size and says 0 free: the tier takes half the memory available as its room.
    less_pool = f", less the {human_bytes(promised)} DRAM pool" if promised else ""
    room = (
        f"{human_bytes(free)} of room (half the memory available{less_pool}: a ramfs has no size of its own, "
        "and nothing bounds it but memory)"
        if ramfs
        else f"{human_bytes(free)} free"
    )
    running = server.stats.storage if server.stats is not None else None
    ours = running.used_bytes if running is not None else 0
    if storage.capacity_bytes is None:
        share = round(AUTO_CAPACITY_FRACTION * 100)
        estimate = auto_capacity_bytes(free, ours)
        if running is not None:
            capacity = running.capacity_bytes
            detail = (
                f"HPKV_KV_STORAGE_SIZE=auto: the running server sized the tier to {human_bytes(capacity)} "
                f"({share}% of {'half the memory available' if ramfs else 'the space free'} when it started, "
                f"plus {share}% of what its files took); "
                f"{room} now"
            )
        else:
            capacity = estimate
            detail = (
                f"HPKV_KV_STORAGE_SIZE=auto: a server starting now sizes the tier to {human_bytes(capacity)} "
                f"({share}% of the {room}, plus {share}% of what HPKV's files already take there)"
            )
        if little_room(capacity):
            fix = (
                "free memory on this node (then restart the server), set HPKV_KV_STORAGE_SIZE, or point "
                "HPKV_KV_STORAGE_PATH at an SSD or a parallel file system"
                if ramfs
                else "free space on that file system (then restart the server), set HPKV_KV_STORAGE_SIZE, or point "
                "HPKV_KV_STORAGE_PATH at a larger file system"
            )
            return Check(
                name,
                Verdict.WARN,
                f"{detail}: little room, so KV files are evicted soon after they are written (none are written at 0 B)",
                fix,
            )
        return Check(name, Verdict.OK, detail)
    held = f" plus {human_bytes(ours)} HPKV holds there" if server.stats is not None else ""
    if storage.capacity_bytes > free + ours:
        if ramfs:
            return Check(
                name,
                Verdict.WARN,
                f"HPKV_KV_STORAGE_SIZE={human_bytes(storage.capacity_bytes)} is more than the {room}"
                f"{held}: KV files on this ramfs may take memory the engines and the pool need",
                f"lower HPKV_KV_STORAGE_SIZE to at most {human_bytes(free + ours)}, or point "
                "HPKV_KV_STORAGE_PATH at an SSD or a parallel file system",
            )
        return Check(
            name,
            Verdict.WARN,
            f"HPKV_KV_STORAGE_SIZE={human_bytes(storage.capacity_bytes)} is more than the "
            f"{room}{held}: writes will meet a full disk and evict early or be dropped",
            f"lower HPKV_KV_STORAGE_SIZE to at most {human_bytes(free + ours)}, or set it to auto",
        )
    return Check(name, Verdict.OK, f"HPKV_KV_STORAGE_SIZE={human_bytes(storage.capacity_bytes)} fits: {room}{held}")
