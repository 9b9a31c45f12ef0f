"""The system calls of the storage tier, behind one seam.

`FileIO` is the real thing (plain `os` calls; `preadv`/`pwritev` release the GIL). Tests subclass
it to inject faults (EIO, ENOSPC, short writes, flipped bits) exactly where the OS would produce
them; the tier must turn every one of them into a miss or a dropped write, never into wrong bytes.
`write_entry_file` is the one way an entry file is published, in the server or in a writer
process (`writer.py`).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass


class FileIO:
    # Files are 0600 and directories 0700: KV is computed from users' prompts.
    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags | os.O_CLOEXEC, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def stat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def preadv(self, fd: int, buffers: list, offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)


@dataclass(frozen=True)
class FileTarget:
    """Where one entry file goes: written as `tmp` in `directory` (created first when `mkdir`),
    then renamed to `final`."""

    final: str
    tmp: str
    directory: str
    mkdir: bool


def write_entry_file(io: FileIO, target: FileTarget, buffers: list, fsync: str) -> OSError | None:
    """Create `target.tmp` exclusively, write `buffers`, rename it into place. Atomic on failure:
    returns the error after removing the temporary it created (never one of the same name that
    someone else created), and nothing appears under `target.final`."""
    size = sum(len(b) for b in buffers)
    created = False
    try:
        if target.mkdir:
            os.makedirs(target.directory, mode=0o700, exist_ok=True)
        fd = io.open(target.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        created = True
        try:
            if io.pwritev(fd, buffers, 0) != size:
                raise OSError(errno.ENOSPC, "short write")
            if fsync != "off":
                io.fdatasync(fd)
        finally:
            io.close(fd)
        io.rename(target.tmp, target.final)
        if fsync == "full":
            io.fsync_dir(target.directory)
        return None
    except OSError as exc:
        if created:
            try:
                os.unlink(target.tmp)
            except OSError:
                pass
        return exc
