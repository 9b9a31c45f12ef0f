"""Pool and storage configs on a test's directories, with the tests' defaults."""

from __future__ import annotations

from pathlib import Path

from hpkv.config import PoolConfig, StorageConfig


def make_storage_config(
    path: Path, capacity_bytes: int | None = None, fsync: str = "off", io_threads: int = 4
) -> StorageConfig:
    return StorageConfig(
        path=Path(path), enabled=True, capacity_bytes=capacity_bytes, fsync=fsync, io_threads=io_threads
    )


def make_pool_config(path: Path, size_bytes: int = 64 << 20) -> PoolConfig:
    return PoolConfig(dir=Path(path), size_bytes=size_bytes)
