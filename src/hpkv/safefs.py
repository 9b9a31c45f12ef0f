"""Opening a file in a directory someone else might write to, without trusting the name.

A name there may have been replaced by a symbolic link (to a file of the planter's choosing), a
FIFO (an open or read that never returns), a directory or a device. So every open here is
`O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC` and is then `fstat`-checked: the descriptor must be a regular
file owned by one of the uids the caller trusts. A socket cannot be opened: it is `lstat`-checked.

Primitives: `owners(extra)` (this uid, root and `extra`); `open_file(path, flags, trusted)`,
`check_socket(path, trusted)`, `read_tail(path, trusted)`; `UnsafeFile`, naming the path and
what is wrong with it. The caller adds the fix in its own words (which setting, which command).
Must not know: HPKV's file names or settings.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from .errors import HpkvError

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISREG, "a regular file"),
)


class UnsafeFile(HpkvError):
    """`path` is not what the caller may use: `why` says what it is instead."""

    def __init__(self, path: Path | str, why: str) -> None:
        super().__init__(f"{path} {why}")
        self.path = Path(path)
        self.why = why


def owners(extra: Iterable[int] = ()) -> frozenset[int]:
    """The uids whose files this process trusts: its own, root's, and `extra`."""
    return frozenset((os.geteuid(), 0, *extra))


def kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _check(path: Path | str, st: os.stat_result, want, want_name: str, trusted: frozenset[int] | None) -> None:
    if not want(st.st_mode):
        raise UnsafeFile(path, f"is {kind(st.st_mode)}, not {want_name}")
    if trusted is not None and st.st_uid not in trusted:
        raise UnsafeFile(
            path,
            f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
            + ("" if os.geteuid() == 0 else " or root"),
        )


def open_file(path: Path | str, flags: int, trusted: frozenset[int], mode: int = 0o600) -> int:
    """Open `path` (flags such as O_RDWR|O_CREAT) without following a link or blocking on a FIFO,
    and return the descriptor once it is known to be a regular file of a trusted uid.
    UnsafeFile otherwise; OSError for the other failures of `open` (ENOENT, EACCES...)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(path, "is a symbolic link") from None
        if exc.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise UnsafeFile(path, "is a FIFO, not a regular file") from None
        if exc.errno == errno.EISDIR:
            raise UnsafeFile(path, "is a directory, not a regular file") from None
        raise
    try:
        _check(path, os.fstat(fd), stat.S_ISREG, "a regular file", trusted)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_socket(path: Path | str, trusted: frozenset[int] | None) -> bool:
    """Whether `path` exists; UnsafeFile if it is there but is not a socket (of a trusted uid,
    unless `trusted` is None: the caller checks its peer's uid instead). `lstat`: a link planted
    in its place is not followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    _check(path, st, stat.S_ISSOCK, "a socket", trusted)
    return True


def read_tail(path: Path | str, trusted: frozenset[int], max_bytes: int = 4096) -> str:
    """The last `max_bytes` of a regular file of a trusted uid, as text; UnsafeFile or OSError."""
    fd = open_file(path, os.O_RDONLY, trusted)
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, max_bytes, max(0, size - max_bytes)).decode(errors="replace")
    finally:
        os.close(fd)
