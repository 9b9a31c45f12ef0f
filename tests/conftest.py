"""Shared fixtures: real directories on a real tmpfs (/dev/shm) and on the disk, a server test's
node, an `hpkv server` child with its environment, and the tiny model the vLLM engine tests serve;
the hooks of `helpers.engines` (the vLLM skip, the tally of engine starts). Helpers live in the
`helpers` package."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from helpers.engines import Tally, skip_without_vllm


def _fresh_shm_dir(prefix: str):
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_dir():
    """A fresh directory on /dev/shm (tmpfs), removed afterwards."""
    yield from _fresh_shm_dir("hpkv-test-")


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


@pytest.fixture
def pool_dir():
    """The pool directory of an `hpkv server` child (`server`): another fresh one on /dev/shm."""
    yield from _fresh_shm_dir("hpkv-cli-")


@pytest.fixture
def env(pool_dir, tmp_path):
    """The environment of `hpkv` commands against `server`: test directories, metrics on a free port."""
    from helpers.cli import free_port, hpkv_env

    return hpkv_env(pool_dir, tmp_path / "storage", tmp_path, HPKV_METRICS_PORT=str(free_port()))


@pytest.fixture
def server(env, tmp_path):
    """`hpkv server` as a child process, stopped after."""
    from helpers.cli import ServerProcess

    process = ServerProcess(env, tmp_path / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def model():
    """The vLLM engine tests' tiny random Qwen2 (`helpers.vllm.MODEL_DIR`)."""
    from helpers.vllm import MODEL_DIR
    from hpkv.demo.model import build_model

    return build_model(MODEL_DIR)


_TALLY = Tally()


@pytest.fixture(scope="session")
def netfs_beds_up():
    """GlusterFS and MooseFS, each mounted twice, up once for the whole session (name -> `Shared`,
    or -> why it is not up): every netfs test works in a fresh directory of its own on them."""
    from bench.harness.netfs import netfs_beds

    with netfs_beds() as beds:
        yield beds


def pytest_configure(config):
    _TALLY.install()


def pytest_collection_modifyitems(config, items):
    skip_without_vllm(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _TALLY.enter(item)  # engine starts in this test's set-up (module fixtures) count for its module
    try:
        return (yield)
    finally:
        _TALLY.enter(None)


def pytest_terminal_summary(terminalreporter):
    _TALLY.report(terminalreporter.write_line)
