"""Shared fixtures: real directories on a real tmpfs (/dev/shm) and on the disk, a server test's
node, and the tiny model the vLLM engine tests serve. Helpers live in the `helpers` package."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


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


@pytest.fixture
def node(shm_dir, tmp_path):
    """A `helpers.server.Node` on `shm_dir` (no server started); whatever it started is killed after."""
    from helpers.server import Node

    node = Node(shm_dir, tmp_path)
    yield node
    node.close()


@pytest.fixture(scope="module")
def model():
    """The vLLM engine tests' tiny random Qwen2 (`helpers.vllm.MODEL_DIR`)."""
    from helpers.vllm import MODEL_DIR

    from hpkv.demo.model import build_model

    return build_model(MODEL_DIR)


def pytest_configure(config):
    # Engine tests outside test_vllm_e2e.py carry this mark, so `-k "not vllm_e2e"` leaves them out too.
    config.addinivalue_line("markers", "vllm_e2e: starts real vLLM engines (run under flock /tmp/hpkv-engine.lock)")
