"""The storage root at start: made where missing, then either usable or refused with what is wrong
and what to do about it.

Two kinds of refusal. `StorageError` for a path that can never hold KV files (on a kernel pseudo
file system: a setting to correct). `StorageUnusable` (a StorageError) for a directory that cannot
be used as it stands (read-only, not writable by this uid, a file in the way): a server goes on
with its DRAM tier and says why (`store.create_store`), since losing the DRAM tier over it helps
no one. The same words serve `hpkv doctor` (`problem`), which changes nothing.

Primitives: `StorageUnusable`, `prepare(root) -> fs_type`, `problem(root)`, `read_only(path)`,
`foreign_writers(root, uid)`, `say_memory_fs` (the warning for a root on ramfs or tmpfs).
Must not know: the index, the files inside the tree.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import stat
from pathlib import Path

from ..errors import StorageError
from ..fsinfo import PSEUDO_FS, existing_ancestor, mount_of

log = logging.getLogger("hpkv.storage.tier")

SETTING = "HPKV_KV_STORAGE_PATH"


class StorageUnusable(StorageError):
    """The storage directory cannot be used as it stands; the message names it, the problem and
    the fix."""


def prepare(root: Path) -> str:
    """Make `root` (0700) where missing and check it is a directory this uid can write to; its
    file system type. StorageError for a pseudo file system, StorageUnusable for the rest."""
    fs_type = mount_of(root).fs_type
    if fs_type in PSEUDO_FS:
        raise StorageError(
            f"the storage directory {root} ({SETTING}) is on {fs_type}, a kernel pseudo file system that cannot "
            f"hold KV files; point {SETTING} at an SSD or a parallel file system"
        )
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # a file in the way: `problem` names it
    except OSError as exc:
        raise StorageUnusable(_cannot_create(root, exc)) from None
    why = problem(root)
    if why is not None:
        raise StorageUnusable(why)
    return fs_type


def say_memory_fs(
    root: Path, fs_type: str, auto: bool, capacity_bytes: int, promised_ram_bytes: int, fraction: float
) -> None:
    """Warn that the root is on a memory file system, and how the tier was sized there."""
    share = round(fraction * 100)
    if not auto:
        size = f"HPKV_KV_STORAGE_SIZE bounds it to {capacity_bytes} bytes"
    elif fs_type == "ramfs":
        pool = f", less the DRAM pool's {promised_ram_bytes} bytes still to come" if promised_ram_bytes else ""
        size = (
            f"HPKV_KV_STORAGE_SIZE=auto gave {capacity_bytes} bytes ({share}% of half the memory "
            f"available{pool}: a ramfs has no size of its own), plus {share}% of its KV files already there"
        )
    else:
        size = (
            f"HPKV_KV_STORAGE_SIZE=auto gave {capacity_bytes} bytes ({share}% of the {fs_type}'s free "
            f"space), plus {share}% of its KV files already there"
        )
    log.warning(
        "the storage directory %s is on %s, a memory file system: its KV files take RAM beside the "
        "DRAM pool and are lost at reboot; %s. Set HPKV_KV_STORAGE_SIZE to bound it, or point "
        "HPKV_KV_STORAGE_PATH at an SSD or a parallel file system",
        root,
        fs_type,
        size,
    )


def problem(root: Path) -> str | None:
    """Why the existing directory `root` cannot hold this uid's KV files, with the fix; None if
    it can (or does not exist yet)."""
    uid = os.geteuid()
    try:
        st = root.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return (
            f"the storage directory {root} ({SETTING}) cannot be looked at by uid {uid}: {exc.strerror}; "
            f"give uid {uid} access to it, or point {SETTING} elsewhere"
        )
    if not stat.S_ISDIR(st.st_mode):
        return (
            f"the storage directory {root} ({SETTING}) is not a directory (a file is in the way); remove it "
            f"or point {SETTING} elsewhere"
        )
    if read_only(root):
        mount = mount_of(root).mount_point
        return (
            f"the storage directory {root} ({SETTING}) is on a read-only mount ({mount}): no KV file can be "
            f"written there; remount it read-write (mount -o remount,rw {mount}) or point {SETTING} at a "
            "writable directory"
        )
    if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        return (
            f"the storage directory {root} ({SETTING}) is not a writable directory for uid {uid} (owner uid "
            f"{st.st_uid}, mode {st.st_mode & 0o7777:04o}); as its owner or root: chown {uid} {root} && "
            f"chmod 700 {root}, or point {SETTING} elsewhere"
        )
    return None


def read_only(path: Path) -> bool:
    """Whether `path` is on a read-only mount."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _cannot_create(root: Path, exc: OSError) -> str:
    parent = existing_ancestor(root)
    if isinstance(exc, NotADirectoryError) or not parent.is_dir():
        return (
            f"cannot create the storage directory {root} ({SETTING}): {parent} is a file, not a directory; "
            f"point {SETTING} elsewhere"
        )
    if exc.errno == errno.EROFS or read_only(parent):
        return (
            f"cannot create the storage directory {root} ({SETTING}): {parent} is on a read-only mount; "
            f"create it on a writable file system or point {SETTING} elsewhere"
        )
    return (
        f"cannot create the storage directory {root} ({SETTING}) in {parent}: {exc.strerror}; create it "
        f"with write permission for uid {os.geteuid()} or point {SETTING} elsewhere"
    )


def foreign_writers(root: Path, uid: int) -> list[str] | None:
    """Who besides `uid` (and root) can write the root or a namespace directory of the tree, one
    phrase per directory (a link there included: HPKV does not follow it); None where the root
    does not exist."""
    try:
        found = [_writers(str(root), os.stat(root), uid)]
        with os.scandir(root) as entries:
            for entry in entries:
                if len(entry.name) == 32 and all(c in "0123456789abcdef" for c in entry.name):
                    found.append(_writers(entry.path, entry.stat(follow_symlinks=False), uid))
    except FileNotFoundError:
        return None
    except OSError:
        pass  # what could be looked at is said
    return [phrase for phrase in found if phrase]


def _writers(path: str, st: os.stat_result, uid: int) -> str:
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link (HPKV does not follow it: whoever made it can write the tree)"
    mode = st.st_mode & 0o7777
    who = []
    if st.st_uid not in (uid, 0):
        who.append(f"owned by uid {st.st_uid}")
    if mode & 0o020:
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = str(st.st_gid)
        who.append(f"writable by group {group}")
    if mode & 0o002:
        who.append(
            "writable by every user"
            + (" (sticky: they cannot remove HPKV's files, but can add their own)" if mode & stat.S_ISVTX else "")
        )
    return f"{path} (mode {mode:04o}) is " + ", ".join(who) if who else ""
