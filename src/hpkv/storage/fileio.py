"""The system calls of the storage tier, behind one seam.

`FileIO` is the real thing (plain `os` calls; `preadv`/`pwritev` release the GIL). Tests subclass
it to inject faults (EIO, ENOSPC, short writes, flipped bits) exactly where the OS would produce
them; the tier must turn every one of them into a miss or a dropped write, never into wrong bytes.
"""

from __future__ import annotations

import os


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
