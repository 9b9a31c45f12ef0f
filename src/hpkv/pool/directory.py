"""Whether a pool directory (HPKV_SHARE_MEM_FILE_PATH) can be trusted with this user's KV cache.

Whoever can replace the names in the pool directory can plant the pool file, the socket, the
lock or the log. So a pool directory must belong to this uid, root, or a uid the caller trusts
(a client: the uids in HPKV_SERVER_ALLOW_UIDS, whose server it would use anyway), and must not
be writable by group or others unless it has the sticky bit (then only a file's owner may
remove or rename it: a ramfs shared by users, mode 1777). A symbolic link given as the directory
must itself belong to a trusted uid, or its owner could point it elsewhere.

Primitives: `problem(directory, trusted) -> Problem | None` (what is wrong and the fix, for
`hpkv doctor`), `check(directory, trusted)` (PoolError with both), `default_fix(directory)`.
Must not know: what is in the directory (pool, socket...) or how it is created.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import PoolError


@dataclass(frozen=True)
class Problem:
    detail: str
    fix: str


def _uid_name(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def default_fix(directory: Path | None = None) -> str:
    default = f"/dev/shm/hpkv-{os.geteuid()}"
    if directory is not None and os.path.abspath(directory) == default:  # another user made it first
        return (
            "or have root remove it (only its owner or root can), or point HPKV_SHARE_MEM_FILE_PATH at a "
            "directory under a mount or parent only this user can write to"
        )
    return f"or point HPKV_SHARE_MEM_FILE_PATH at a directory of this user's own (the default, {default})"


def problem(directory: Path, trusted: frozenset[int]) -> Problem | None:
    """What makes `directory` untrustworthy, or None (also when it does not exist: its creator
    makes it 0700). `trusted`: the uids that may own it (`safefs.owners`)."""
    directory = Path(directory)
    uid = os.geteuid()
    try:
        link = os.lstat(directory)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in trusted:
        return Problem(
            f"the pool directory {directory} (HPKV_SHARE_MEM_FILE_PATH) is a symbolic link of "
            f"{_uid_name(link.st_uid)}, who can point it at another directory at any time",
            f"name the directory it points to instead, {default_fix(directory)}",
        )
    try:
        st = os.stat(directory)
    except OSError as exc:
        return Problem(
            f"cannot examine the pool directory {directory}: {exc.strerror}",
            f"fix the path or its permissions, {default_fix(directory)}",
        )
    if not stat.S_ISDIR(st.st_mode):
        return None  # the creator's own error names a file in the way
    mode = stat.S_IMODE(st.st_mode)
    where = (
        f"the pool directory {directory} (HPKV_SHARE_MEM_FILE_PATH) belongs to {_uid_name(st.st_uid)}, mode {mode:04o}"
    )
    if st.st_uid not in trusted:
        return Problem(
            f"{where}: that user can replace the pool file, socket, lock and log in it, and so read "
            "or forge this user's KV cache",
            f"as root: chown {uid} {directory} && chmod 700 {directory}, {default_fix(directory)} (a server "
            "run by that uid is trusted only when HPKV_SERVER_ALLOW_UIDS lists it)",
        )
    if mode & 0o022 and not mode & stat.S_ISVTX:
        who = "group and others" if mode & 0o022 == 0o022 else "others" if mode & 0o002 else "its group"
        owner = "" if st.st_uid == uid else "as root: "
        return Problem(
            f"{where}: writable by {who} without the sticky bit, so they can replace the pool file, "
            "socket, lock and log in it, and so read or forge this user's KV cache",
            f"{owner}chmod 700 {directory} (this user's alone), or {owner}chmod 1777 {directory} (shared "
            f"by several users: each one's files are then its own), {default_fix(directory)}",
        )
    return None


def check(directory: Path, trusted: frozenset[int]) -> None:
    """PoolError naming the directory, its owner and mode, and the fix, unless it can be trusted."""
    found = problem(directory, trusted)
    if found is not None:
        raise PoolError(f"refusing {found.detail}; fix: {found.fix}")
