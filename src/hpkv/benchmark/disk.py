"""The disk's own limit for the storage rows: one thread writing the same bytes sequentially to
one new file, then reading them back. Owns nothing else; knows nothing of HPKV's tiers."""

from __future__ import annotations

import os
import time
from pathlib import Path


def disk_limit(
    path: Path, src: memoryview, dst: memoryview, size: int, fsync: str, between=None
) -> tuple[float, float]:
    """Seconds to write `src` to one new file sequentially, `size` bytes a call, then read it back;
    `between` (untimed) runs in between, e.g. to drop the page cache."""
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        for start in range(0, len(src), size):
            _write_all(fd, src[start : start + size])
        if fsync != "off":
            os.fdatasync(fd)
    finally:
        os.close(fd)
    written = time.perf_counter()
    if between is not None:
        between()
    reading = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for start in range(0, len(dst), size):
            if os.preadv(fd, [dst[start : start + size]], start) != size:
                raise RuntimeError(f"short read of {path}")
    finally:
        os.close(fd)
    read = time.perf_counter()
    os.unlink(path)
    return written - started, read - reading


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]
