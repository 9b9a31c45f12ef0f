"""The storage tree, trusted by nothing but its root: opened, walked and changed without
following a link below the root.

The tree (`<root>/<ns>/<ab>/<cd>/<hex>.kv`, `<root>/<ns>/namespace.json`) may be shared by nodes
and writable by others, so a name in it proves nothing. The root is the operator's
HPKV_KV_STORAGE_PATH and is opened once, as configured (a link there is the operator's), then
held (`Root`): a root renamed and replaced while a server runs is reported, never followed. Below
it no link is followed on the way to a name: one `openat2` with RESOLVE_NO_SYMLINKS|RESOLVE_BENEATH
from the root's descriptor where the kernel has it (Linux 5.6), else each directory opened from
its parent's with O_DIRECTORY|O_NOFOLLOW (`open_beneath`, `open_below`). Every file to read is
opened O_NOFOLLOW|O_NONBLOCK and fstat-checked to be a regular file (`check_regular`), every file
to write created O_CREAT|O_EXCL|O_NOFOLLOW in a directory reached so, and every removal is
`unlink(name, dir_fd=)` in such a directory. So a symbolic link, a FIFO
or a directory planted anywhere in the tree is never followed, never blocks a thread, and nothing
outside the tree is read, written or removed with the server's rights. What is found in place of
a directory or a file is `Untrusted` (an OSError naming it): callers skip it and count it.

Primitives: `Untrusted`, `Root` (the root held open), `opened_root` (for another process: checked to be it),
`open_below`, `opened_below` (the same as a context manager),
`open_beneath` (one `openat2` where the kernel has it), `check_regular`, `is_regular`, `kind_of`, `raise_untrusted`,
`parts_below`, `write_description`.
Must not know: the entry format, the index, the pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
import threading
from collections.abc import Callable
from typing import Any, TypeVar, overload

from ..safefs import kind as kind_of  # what a file of st_mode `mode` is, in words

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK  # added to every open of a file in the tree
ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # the root, as configured: a link there is the operator's
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_SYS_OPENAT2 = 437  # one number on every Linux architecture (5.6 and later)
_RESOLVE = 0x04 | 0x08  # RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH
_T = TypeVar("_T")
log = logging.getLogger("hpkv.storage.tier")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


try:
    _syscall = ctypes.CDLL(None, use_errno=True).syscall
    _syscall.restype = ctypes.c_long
    _openat2_works = os.uname().sysname == "Linux"
except (OSError, AttributeError):
    _openat2_works = False
_NR_OPENAT2 = ctypes.c_long(_SYS_OPENAT2)
# (flags, mode) -> (how, pointer to it, its size): built once, as a read is dominated by such calls;
# the kernel only reads it, so threads share it.
_HOWS: dict[tuple[int, int], tuple[_OpenHow, object, ctypes.c_size_t]] = {}


def _how(flags: int, mode: int) -> tuple[_OpenHow, object, ctypes.c_size_t]:
    how = _HOWS.get((flags, mode))
    if how is None:
        struct = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, _RESOLVE)
        how = _HOWS[(flags, mode)] = (struct, ctypes.byref(struct), ctypes.c_size_t(ctypes.sizeof(struct)))
    return how


class Untrusted(OSError):
    """A name in the storage tree that is not what HPKV puts there (a link, a FIFO, a device, a
    directory where a file belongs): not followed, not read, not adopted."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(
            errno.ELOOP if what == "a symbolic link" else errno.EINVAL,
            f"{path} is {what}, not followed: HPKV follows no link and reads only regular files "
            "inside the storage tree",
            path,
        )
        self.what = what


def is_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)


def check_regular(st: os.stat_result, path: str) -> None:
    """Raise Untrusted unless `st` (an fstat or lstat) is of a regular file."""
    if not stat.S_ISREG(st.st_mode):
        raise Untrusted(path, kind_of(st.st_mode))


def parts_below(root: str, directory: str) -> list[str]:
    """The names leading from `root` down to `directory` (a path HPKV built by joining names to
    the root); OSError (EINVAL) where `directory` is not a plain path below `root`."""
    root = root.rstrip("/")
    parts = directory[len(root) + 1 :].split("/") if directory.startswith(root + "/") else [""]
    if any(part in ("", ".", "..") for part in parts):
        raise OSError(errno.EINVAL, f"{directory} is not a plain path below {root or '/'}")
    return parts


def open_below(root_fd: int, base: str, parts: list[str] | tuple[str, ...], create: bool = False) -> int:
    """A new descriptor of `parts...` below the directory `root_fd` (the storage root, held open:
    never looked up by name again), reached without following a link (`Untrusted` where one is a
    link or not a directory); with `create`, every missing part is made, mode 0700. `base`:
    `root_fd`'s path, for messages. The caller closes it."""
    if not parts:
        return os.open(".", DIR_FLAGS, dir_fd=root_fd)
    if create:
        return _descend(root_fd, base, parts, create=True)
    return open_beneath(root_fd, "/".join(parts), DIR_FLAGS, base=base)


def open_beneath(dir_fd: int, relpath: str, flags: int, mode: int = 0o600, base: str = "") -> int:
    """`openat(dir_fd, relpath, flags)` that follows no link in the directories on the way (its
    last name is opened as `flags` say: callers add O_NOFOLLOW) and does not leave `dir_fd`'s
    tree. One `openat2` (RESOLVE_NO_SYMLINKS|RESOLVE_BENEATH) where the kernel has it; else, or
    to name what stood in the way, a walk from directory to directory (`Untrusted` for a link or
    a non-directory there). `base`: `dir_fd`'s path, for messages (none: paths relative to it)."""
    global _openat2_works
    path = f"{base}/{relpath}" if base else relpath
    if "/" in relpath and _openat2_works:
        _, how, size = _how(flags, mode)
        fd = _syscall(_NR_OPENAT2, ctypes.c_long(dir_fd), os.fsencode(relpath), how, size)
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a sandbox that forbids it: walk from now on
            _openat2_works = False
        elif err not in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
            raise OSError(err, os.strerror(err), path)
    *dirs, name = relpath.split("/")
    if any(part in ("", ".", "..") for part in relpath.split("/")):
        raise OSError(errno.EINVAL, f"{path} is not a plain path", path)
    parent = _descend(dir_fd, base, dirs, create=False) if dirs else dir_fd
    try:
        try:
            return os.open(name, flags | os.O_CLOEXEC, mode, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and flags & os.O_NOFOLLOW:
                raise_untrusted(parent, name, path, exc)
            raise
    finally:
        if parent != dir_fd:
            os.close(parent)


def _descend(dir_fd: int, base: str, parts, create: bool) -> int:
    """A new descriptor of `dir_fd/parts...` (parts not empty), each opened from its parent's
    without following a link, made first where missing with `create`; `dir_fd` stays open."""
    fd, path = dir_fd, base or "."
    try:
        for part in parts:
            path = f"{path}/{part}"
            if create:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # Linux says ENOTDIR for a link with O_DIRECTORY
                    raise_untrusted(fd, part, path, exc)
                raise
            if fd != dir_fd:
                os.close(fd)
            fd = child
    except BaseException:
        if fd != dir_fd:
            os.close(fd)
        raise
    return fd


def raise_untrusted(dir_fd: int, name: str, path: str, exc: OSError) -> None:
    """Raise Untrusted for what stands at `name` in `dir_fd` (an open of it without following a
    link failed with `exc`: ELOOP or ENOTDIR); `exc` itself where nothing is there."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        raise exc from None
    what = kind_of(st.st_mode)
    raise Untrusted(path, "a file where a directory belongs" if what == "a regular file" else what) from None


class Root:
    """The storage root, opened once (`fd`, by its configured path: a link there is the
    operator's) and never looked up by name again while the tier runs: every open, walk, write
    and removal below it starts from this descriptor. What the path names later is only compared
    with it (`check`: every rescan period, and when a name below the root is not found):
    - the same directory: nothing to do;
    - the held directory removed (`rm -rf` of the root, by whoever could empty it), and a
      directory of this uid (or root) at the path, not a link where the path held none at start
      (`check(create=True)` makes it first, as a write does): that one is held from now on. A
      descriptor replaced so is closed only by `close` (another thread may still be using it);
    - the held directory still there (renamed or moved away) and something else, or nothing, at
      the path: never followed. The tier goes on in the directory it holds, and `replaced` says
      what happened and the fix (logged once per replacement; `hpkv status`, `hpkv doctor`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.id: tuple[int, int] | None = None  # (st_dev, st_ino) of the directory held
        self.replaced: str | None = None  # why the path no longer names it, with the fix
        self._fd: int | None = None
        self._old: list[int] = []
        self._lock = threading.Lock()
        self._path_was_link = False
        self._said: object = None  # the replacement last logged (what the path named then)

    def fd(self) -> int:
        fd = self._fd
        if fd is None:
            with self._lock:
                if self._fd is None:
                    self._path_was_link = os.path.islink(self.path)
                    self._hold(os.open(self.path, ROOT_FLAGS))
                fd = self._fd
                assert fd is not None
        return fd

    @overload
    def open(self, relpath: str, flags: int) -> int: ...
    @overload
    def open(self, relpath: str, flags: int, opener: Callable[..., _T]) -> _T: ...

    def open(self, relpath: str, flags: int, opener: Callable[..., Any] | None = None) -> Any:
        """`opener(relpath, flags, dir_fd=)` (`open_beneath` by default) from the root's descriptor."""
        opener = opener or (lambda path, flags_, dir_fd: open_beneath(dir_fd, path, flags_, base=self.path))
        try:
            return opener(relpath, flags, dir_fd=self.fd())
        except FileNotFoundError:
            if not self.check():
                raise
            return opener(relpath, flags, dir_fd=self.fd())

    def check(self, create: bool = False) -> bool:
        """Compare what the path names with the directory held (see the class); whether another
        directory is held now. With `create`, a root removed is made again (0700) first."""
        with self._lock:
            if self._fd is None:
                return False
            try:
                held: os.stat_result | None = os.fstat(self._fd)
            except OSError:  # ESTALE: a network file system's directory removed
                held = None
            try:
                now: os.stat_result | None = os.stat(self.path)
            except FileNotFoundError:
                now = None
            except OSError:
                return False
            if now is not None and held is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                self.replaced = None
                return False
            if held is not None and held.st_nlink > 0:
                self._say_replaced(now)
                return False
            return self._take_path(create, now)

    def _take_path(self, create: bool, now: os.stat_result | None) -> bool:
        """The held root is removed: hold the directory at the path instead, if it is one of
        this uid (or root) and no link where none was. Caller holds the lock."""
        if now is None:
            if not create:
                return False
            try:
                os.makedirs(self.path, mode=0o700, exist_ok=True)
            except OSError:
                return False
        try:
            fd = os.open(self.path, ROOT_FLAGS | (0 if self._path_was_link else os.O_NOFOLLOW))
        except OSError:  # ELOOP, ENOTDIR: a link, or a file, where the root was
            self._say_replaced(now)
            return False
        if os.fstat(fd).st_uid not in (os.geteuid(), 0):
            os.close(fd)
            self._say_replaced(now)
            return False
        self._old.append(self._fd)  # type: ignore[arg-type]  # held: `check` saw it
        self._hold(fd)
        self.replaced = None
        log.info("the storage directory %s was removed and made again: the server uses the new one", self.path)
        return True

    def _hold(self, fd: int) -> None:
        st = os.fstat(fd)
        self._fd, self.id = fd, (st.st_dev, st.st_ino)

    def _say_replaced(self, now: os.stat_result | None) -> None:
        """Caller holds the lock."""
        try:
            where = os.readlink(f"/proc/self/fd/{self._fd}")
        except OSError:
            where = "a path this server cannot tell"
        parent = os.path.dirname(self.path.rstrip("/")) or "/"
        what = "nothing is there now" if now is None else f"{kind_of(now.st_mode)} of another inode is there now"
        self.replaced = (
            f"the storage directory {self.path} was moved away while the server runs ({what}): the server "
            f"follows nothing at that name and goes on with the directory it opened at start, now {where}. If "
            f"that was meant, restart the server to use what {self.path} names now; if not, whoever can write "
            f"{parent} moved it: put it back, and keep {parent} writable by this uid alone"
        )
        said = None if now is None else (now.st_dev, now.st_ino)
        if said != self._said:
            self._said = said
            log.warning("%s", self.replaced)

    def close(self) -> None:
        with self._lock:
            for fd in [*self._old, *([self._fd] if self._fd is not None else [])]:
                os.close(fd)
            self._fd, self._old = None, []


def opened_root(path: str, root_id: tuple[int, int] | None) -> int:
    """A new descriptor of the storage root at `path` (as configured: its links followed), for a
    process that does not hold the tier's (a write-through process); OSError (ESTALE) where
    `root_id`, the (st_dev, st_ino) the tier holds, is not what the path names now (the root
    replaced: not followed). The caller closes it."""
    fd = os.open(path, ROOT_FLAGS)
    st = os.fstat(fd)
    if root_id is not None and (st.st_dev, st.st_ino) != tuple(root_id):
        os.close(fd)
        raise OSError(
            errno.ESTALE,
            f"{path} is no longer the storage directory the server opened (replaced while it runs): not followed",
            path,
        )
    return fd


@contextlib.contextmanager
def opened_below(root_fd: int, base: str, parts, create: bool = False):
    """`open_below` for a `with` block: the descriptor is closed after it."""
    fd = open_below(root_fd, base, parts, create)
    try:
        yield fd
    finally:
        os.close(fd)


def write_description(root: Root, ns: str, name: str, tmp_name: str, text: str) -> bool:
    """Put `text` at `<root>/<ns>/<name>` unless a regular file is there already (the namespace
    directory made where missing); False where one was. Written to `tmp_name`, created
    exclusively without following a link, then renamed over whatever else held the name (a
    planted link is replaced, its target untouched). OSError (Untrusted among them) where it
    cannot; the temporary is then removed."""
    with opened_below(root.fd(), root.path, [ns], create=True) as dir_fd:
        try:
            if is_regular(os.stat(name, dir_fd=dir_fd, follow_symlinks=False)):
                return False
        except FileNotFoundError:
            pass
        fd = os.open(tmp_name, CREATE_FLAGS, 0o600, dir_fd=dir_fd)
        try:
            try:
                data = text.encode()
                while data:
                    data = data[os.write(fd, data) :]
            finally:
                os.close(fd)
            os.rename(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name, dir_fd=dir_fd)
            raise
    return True
