"""What a benchmark ran on: processors, memory, kernel, the file system of each path it used,
and the disk's own limit the storage rows are compared to.

Figures mean little without this, so every report carries it. `disk_limit` is one thread writing
the same bytes sequentially to one new file, then reading them back: it knows nothing of HPKV's
tiers.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import TypedDict

import numpy as np

from ..fsinfo import mount_of


class _PathInfo(TypedDict):
    path: str
    fs_type: str
    mount_point: str
    source: str


class PathInfo(_PathInfo, total=False):
    huge_pages: str  # a tmpfs's huge=, where it has one


class Machine(TypedDict):
    cpus: int | None
    cpu_model: str
    memory_bytes: int
    kernel: str
    python: str
    numpy: str
    load_avg_1m: float
    pool_dir: PathInfo
    storage_dir: PathInfo


def describe(pool_dir: Path, storage_dir: Path) -> Machine:
    return {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": _mem_total_bytes(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        # Other work on the machine skews every figure; the load at the start says how busy it was.
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "pool_dir": _path_info(pool_dir),
        "storage_dir": _path_info(storage_dir),
    }


def _path_info(path: Path) -> PathInfo:
    mount = mount_of(path)
    info: PathInfo = {
        "path": str(path),
        "fs_type": mount.fs_type,
        "mount_point": mount.mount_point,
        "source": mount.source,
    }
    if mount.huge_pages is not None:
        info["huge_pages"] = mount.huge_pages  # a tmpfs's huge= (docs/operations.md, "Huge pages")
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


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
