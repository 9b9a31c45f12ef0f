"""Shared fixtures: real directories on a real tmpfs (/dev/shm) and on the disk."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from hpkv.config import PoolConfig, StorageConfig


@pytest.fixture
def shm_dir():
    """A fresh directory on /dev/shm (tmpfs), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="hpkv-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def storage_dir(tmp_path):
    path = tmp_path / "storage"
    path.mkdir()
    return path


def make_storage_config(path: Path, capacity_bytes: int | None = None, fsync: str = "off",
                        io_threads: int = 4) -> StorageConfig:
    return StorageConfig(path=Path(path), enabled=True, capacity_bytes=capacity_bytes, fsync=fsync,
                         io_threads=io_threads)


def make_pool_config(path: Path, size_bytes: int = 64 << 20) -> PoolConfig:
    return PoolConfig(dir=Path(path), size_bytes=size_bytes)


def pytest_configure(config):
    # Engine tests outside test_vllm_e2e.py carry this mark, so `-k "not vllm_e2e"` leaves them out too.
    config.addinivalue_line("markers", "vllm_e2e: starts real vLLM engines (run under flock /tmp/hpkv-engine.lock)")
    config.addinivalue_line("markers", "engine: starts a real engine process; `make test-core` runs -m 'not engine'")


def pytest_collection_modifyitems(config, items):
    # Every vLLM end-to-end test is an engine test: those of test_vllm_e2e.py (its name carries
    # the mark for -k) and those marked vllm_e2e elsewhere. `-m "not engine"` leaves them out.
    for item in items:
        if item.path.name == "test_vllm_e2e.py" or item.get_closest_marker("vllm_e2e") is not None:
            item.add_marker(pytest.mark.engine)
