"""The system calls of the storage tier, behind one seam.

`FileIO` is the real thing (plain `os` calls; `preadv`/`pwritev` release the GIL). Tests subclass
it to inject faults (EIO, ENOSPC, short writes, flipped bits) exactly where the OS would produce
them; the tier must turn every one of them into a miss or a dropped write, never into wrong bytes.
`write_entry_file` is the one way an entry file is published, in the server or in a writer
process (`writer.py`).

Direct I/O (`O_DIRECT`, HPKV_KV_STORAGE_DIRECT_IO): the bytes go between the pool slot and the
device without a copy through the page cache, and without the kernel's writeback afterwards. It
needs every buffer, file offset and length aligned (`ALIGN`); a file system that refuses it
(`EINVAL`) gets the same bytes through the page cache instead, so direct I/O is never a reason
for a write or a read to fail.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import math
import mmap
import os
import secrets
import socket
import time
from dataclasses import dataclass, field

from .format import ALIGN
from .tree import (
    CREATE_FLAGS,
    FILE_FLAGS,
    Root,
    Untrusted,
    check_regular,
    open_below,
    open_beneath,
    opened_root,
    parts_below,
)

log = logging.getLogger(__name__)

O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none: never direct
DIR_SYNC_WARN_EVERY_S = 600.0
_dir_sync_warned_at = -math.inf


class FileIO:
    # Files are 0600 and directories 0700: KV is computed from users' prompts. Names may be
    # relative to `dir_fd`, a directory opened without following links (`tree`).
    def open(self, path: str, flags: int, mode: int = 0o600, dir_fd: int | None = None) -> int:
        """With `dir_fd`, `path` is relative to it and no link is followed in the directories on
        the way (`tree.open_beneath`)."""
        if dir_fd is None:
            return os.open(path, flags | os.O_CLOEXEC, mode)
        return open_beneath(dir_fd, path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def stat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def stat_path(self, path: str, dir_fd: int | None = None) -> os.stat_result:
        """The file at `path` (relative to `dir_fd`, where given) itself: a link there is not followed."""
        return os.stat(path, dir_fd=dir_fd, follow_symlinks=False)

    def list_dir(self, dir_fd: int) -> list[os.DirEntry]:
        """What the open directory `dir_fd` holds (a listing of a duplicate of it: `dir_fd` stays open)."""
        with os.scandir(dir_fd) as it:
            return list(it)

    def preadv(self, fd: int, buffers: list, offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync_dir(self, dir_fd: int) -> None:
        os.fsync(dir_fd)

    def rename(self, src: str, dst: str, dir_fd: int | None = None) -> None:
        """Both names in one directory: `dir_fd`'s, where given."""
        os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def unlink(self, path: str, dir_fd: int | None = None) -> None:
        os.unlink(path, dir_fd=dir_fd)

    def set_direct(self, fd: int, on: bool) -> None:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | O_DIRECT) if on else (flags & ~O_DIRECT))


def open_in_tree(io: FileIO, root: Root, parts, name: str, flags: int) -> tuple[int, os.stat_result]:
    """Open the file `name` in `root/parts...` for reading, following no link below the root and
    never blocking (a FIFO): (fd, its fstat); `tree.Untrusted` unless it is a regular file. The
    caller closes it."""
    relpath = "/".join((*parts, name))
    try:
        return root.open(relpath, flags, lambda path, flags_, dir_fd: _open_regular(io, dir_fd, path, flags_))
    except Untrusted as exc:
        raise Untrusted(f"{root.path}/{exc.filename}", exc.what) from None


def _open_regular(io: FileIO, dir_fd: int, relpath: str, flags: int) -> tuple[int, os.stat_result]:
    try:
        fd = io.open(relpath, flags | FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        # O_DIRECT is refused (EINVAL) by a file system, and for a FIFO or a directory too: that
        # one must not be taken for the file system's refusal (direct I/O off for good).
        if exc.errno == errno.EINVAL and flags & O_DIRECT:
            io.close(_open_regular(io, dir_fd, relpath, flags & ~O_DIRECT)[0])
        raise
    try:
        st = io.stat(fd)
        check_regular(st, relpath)  # O_NONBLOCK may stay: Linux ignores it for a regular file's reads
    except BaseException:
        io.close(fd)
        raise
    return fd, st


def close_quietly(io: FileIO, fd: int) -> None:
    """Close a descriptor opened for reading. An error here (ESTALE on a network file system
    whose file was replaced meanwhile, EIO) changes nothing of what was read and checked: the
    descriptor is gone all the same (Linux frees it whatever close returns)."""
    try:
        io.close(fd)
    except OSError:
        pass


def aligned(buf) -> bool:
    """Whether a writable buffer's address and length suit O_DIRECT."""
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):  # read-only, or empty: cannot tell, so not direct
        return False
    return address % ALIGN == 0 and len(buf) % ALIGN == 0


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Zeroed page-aligned memory of at least `nbytes`, a multiple of ALIGN (for O_DIRECT)."""
    return mmap.mmap(-1, -(-max(nbytes, 1) // ALIGN) * ALIGN)


def aligned_copy(data: bytes) -> mmap.mmap:
    """`data` in page-aligned memory, zero-padded to a multiple of ALIGN (a header, for O_DIRECT)."""
    buf = aligned_buffer(len(data))
    buf.write(data)
    return buf


def transfer(io: FileIO, fd: int, op, buffers: list, direct: bool, offset: int = 0) -> int:
    """`op(fd, buffers, offset)` (io.preadv or io.pwritev); where a direct transfer is refused
    (EINVAL: a buffer, length or device it would not take), the same through the page cache."""
    try:
        return op(fd, buffers, offset)
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
        io.set_direct(fd, False)
        return op(fd, buffers, offset)


def read_full(io: FileIO, fd: int, buffers: list, direct: bool) -> int:
    """Read the file from its start into `buffers` until they are full or a read returns 0 (the
    file ended); the bytes read. One preadv may return fewer bytes than asked with more to come
    (a signal, a network file system's transfer size): that is not a short file."""
    total = sum(len(b) for b in buffers)
    done = transfer(io, fd, io.preadv, buffers, direct)
    while 0 < done < total:
        rest = _after(buffers, done)
        try:
            got = transfer(io, fd, io.preadv, rest, direct, offset=done)  # EINVAL where unaligned: page cache
        finally:
            for view in rest:
                view.release()  # its owner cannot close an mmap buffer while a view of it lives
        if got == 0:
            break
        done += got
    return done


def _after(buffers: list, skip: int) -> list[memoryview]:
    """Views of what `buffers` hold past their first `skip` bytes."""
    views = []
    for buf in buffers:
        if skip >= len(buf):
            skip -= len(buf)
            continue
        with memoryview(buf) as whole:
            views.append(whole[skip:])
        skip = 0
    return views


def open_direct(io: FileIO, path: str, flags: int, dir_fd: int | None = None) -> tuple[int, bool]:
    """Open with O_DIRECT, or without it where the file system refuses it; (fd, direct). With
    O_CREAT, the refused open may have created the file already (Linux checks O_DIRECT after
    creating it): it is removed first, so the caller's O_EXCL still means "ours"."""
    if O_DIRECT:
        try:
            return io.open(path, flags | O_DIRECT, dir_fd=dir_fd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            if flags & os.O_CREAT:
                try:
                    os.unlink(path, dir_fd=dir_fd)
                except OSError:
                    pass
    return io.open(path, flags, dir_fd=dir_fd), False


def direct_supported(directory: str) -> bool:
    """Whether files in `directory` take aligned O_DIRECT writes (one probe file, removed). The
    probe's name is this call's alone (host, pid, a random token), so servers of several nodes
    sharing the directory never remove one another's probes."""
    if not O_DIRECT:
        return False
    node = socket.gethostname().replace(".", "_")
    path = os.path.join(directory, f".direct-probe.{node}.{os.getpid()}.{secrets.token_hex(8)}")
    buf = aligned_buffer(ALIGN)
    try:
        try:
            fd = os.open(path, CREATE_FLAGS | O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # Linux refuses O_DIRECT after creating the file: ours to remove
                _unlink_quietly(path)
            return False  # never after EEXIST: that file is somebody else's
        try:
            return os.pwritev(fd, [buf], 0) == len(buf)
        except OSError:
            return False
        finally:
            os.close(fd)
            _unlink_quietly(path)
    finally:
        buf.close()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone already (someone cleaning the directory), or a device error: not ours to raise
        pass


@dataclass(frozen=True)
class FileTarget:
    """Where one entry file goes: written as `tmp` in `directory` (created first when `mkdir`),
    then renamed to `final`; both are names in `directory`. With `root`, `directory` is below it
    in the storage tree, and every directory between them is opened (and made) from the root's
    descriptor without following a link (`tree.open_below`): `root_fd`, the tier's held root, in
    its process; in another (a write-through process), the root opened by its path and checked to
    be the directory `root_id` names (a root replaced since is not followed). Without `root`,
    `directory` is trusted as given."""

    final: str
    tmp: str
    directory: str
    mkdir: bool
    root: str | None = None
    root_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the root the tier holds
    root_fd: int | None = field(default=None, compare=False)  # the tier's held root, in its process only

    def open_directory(self, root_fd: int | None = None) -> int:
        """A descriptor of `directory` (made first when `mkdir`), from `root_fd` (else the held
        root, else the root opened as `tree.opened_root` does); `tree.Untrusted` where a link or
        a non-directory stands in the way below `root`."""
        if self.root is not None:
            parts = parts_below(self.root, self.directory)
            fd = root_fd if root_fd is not None else self.root_fd
            if fd is not None:
                return open_below(fd, self.root, parts, create=self.mkdir)
            fd = opened_root(self.root, self.root_id)
            try:
                return open_below(fd, self.root, parts, create=self.mkdir)
            finally:
                os.close(fd)
        if self.mkdir:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
        return os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def write_entry_file(
    io: FileIO, target: FileTarget, buffers: list, fsync: str, direct: bool = False, dir_fd: int | None = None
) -> OSError | None:
    """Create `target.tmp` exclusively (never through a link), write `buffers`, rename it into
    place, all by name in the directory `target.open_directory()` gives (or `dir_fd`, the
    caller's: left open). Atomic on failure:
    returns the error after removing the temporary it created (never one of the same name that
    someone else created), and nothing appears under `target.final`. With `direct`, every buffer
    after the first (the header, copied to aligned memory here) must be aligned already; the
    file is written with O_DIRECT where the file system takes it, through the page cache where
    not. Once renamed the file is published: a directory fsync that fails after it (fsync
    `full`) is a warning (`_sync_dir`), not an error."""
    size = sum(len(b) for b in buffers)
    created = False
    header = None
    own_dir = dir_fd is None
    tmp, final = os.path.basename(target.tmp), os.path.basename(target.final)
    try:
        if dir_fd is None:
            dir_fd = target.open_directory()
        fd, direct = (
            open_direct(io, tmp, CREATE_FLAGS, dir_fd) if direct else (io.open(tmp, CREATE_FLAGS, dir_fd=dir_fd), False)
        )
        created = True
        try:
            if direct and len(buffers[0]) % ALIGN == 0:
                header = aligned_copy(buffers[0])
                buffers = [header, *buffers[1:]]
            elif direct:
                io.set_direct(fd, False)
                direct = False
            if transfer(io, fd, io.pwritev, buffers, direct) != size:
                raise OSError(errno.ENOSPC, "short write")
            if fsync != "off":
                io.fdatasync(fd)
        finally:
            io.close(fd)
        io.rename(tmp, final, dir_fd=dir_fd)
        if fsync == "full":
            _sync_dir(io, dir_fd, target.directory)
        return None
    except OSError as exc:
        if created:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
        return exc
    finally:
        if header is not None:
            header.close()
        if own_dir and dir_fd is not None:
            os.close(dir_fd)


def remove_temp(target: FileTarget) -> None:
    """Remove `target.tmp` (a writer that died with it) by name in its directory, following no
    link to get there; quietly where it is gone or cannot be."""
    try:
        dir_fd = FileTarget(
            target.final, target.tmp, target.directory, False, target.root, target.root_id, target.root_fd
        ).open_directory()
    except OSError:
        return
    try:
        os.unlink(os.path.basename(target.tmp), dir_fd=dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _sync_dir(io: FileIO, dir_fd: int, directory: str) -> None:
    """fsync a directory after a rename into it. A failure does not unpublish the file (it is
    whole and in place: a reader finds it, and the index must count it); it may lose only the
    file's name in a crash, which the checksums make a miss. So a warning, at most every
    DIR_SYNC_WARN_EVERY_S, and not a failed write."""
    global _dir_sync_warned_at
    try:
        io.fsync_dir(dir_fd)
    except OSError as exc:
        now = time.monotonic()
        if now - _dir_sync_warned_at >= DIR_SYNC_WARN_EVERY_S:
            _dir_sync_warned_at = now
            log.warning(
                "cannot fsync the directory %s after publishing a KV file into it: %s; the file is "
                "published, but a crash may lose it (HPKV_KV_STORAGE_FSYNC=full; said at most every %.0f "
                "minutes)",
                directory,
                exc.strerror,
                DIR_SYNC_WARN_EVERY_S / 60,
            )
