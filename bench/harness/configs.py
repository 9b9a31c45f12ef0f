"""Store and tier configurations with the benchmarks' defaults: no fsync, capacity sized by the
store, two I/O threads. Primitives: `storage(path, **overrides)`, `storage_off()`, `pool(dir, size_bytes)`."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hpkv.config import PoolConfig, StorageConfig


def storage(path: Path, **overrides) -> StorageConfig:
    """An enabled storage tier under `path`; `overrides` are StorageConfig fields."""
    fields: dict = {"enabled": True, "capacity_bytes": None, "fsync": "off", "io_threads": 2, **overrides}
    return StorageConfig(path=Path(path), **fields)


def storage_off() -> StorageConfig:
    """No storage tier: every hit is a DRAM hit, and nothing is written through."""
    return storage(Path(tempfile.gettempdir()) / "unused", enabled=False, io_threads=1)


def pool(directory: Path | str, size_bytes: int) -> PoolConfig:
    return PoolConfig(dir=Path(directory), size_bytes=size_bytes)
