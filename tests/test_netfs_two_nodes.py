"""Two nodes sharing one storage directory over a real network file system: GlusterFS with its
default client caching, and MooseFS, each mounted twice on this machine (`bench.harness.netfs`). Node A
and node B are processes with their own host names, each with a real `StorageTier` on its own
mount (`helpers.netfs_node`). The stories: what A writes B reads byte-identical; both writing the
same keys while both read gives never a wrong byte and never an exception; a clear and an
eviction on A while B reads; capacity shared by both; B's start-up scan while A writes; LRU with
mtimes that arrive late."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from bench.harness.netfs import Shared
from helpers.cli import hpkv, hpkv_env
from helpers.keys import entry_keys
from helpers.netfs_node import ENTRY_BYTES, NS
from helpers.netfs_nodes import NodeProcess, poll
from helpers.waiting import wait_for

ENTRY_FILE_BYTES = ENTRY_BYTES + 4096  # an upper bound on header + payload
BIG = 1 << 30


pytestmark = pytest.mark.netfs


@pytest.fixture(scope="module")
def beds(netfs_beds_up):
    return netfs_beds_up


@pytest.fixture(params=["glusterfs", "moosefs"])
def fs(request, beds) -> Shared:
    bed = beds[request.param]
    if isinstance(bed, str):
        pytest.skip(bed)
    return bed


@pytest.fixture
def root(fs):
    """A fresh storage directory on the shared file system: (A's path, B's path)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    (fs.mount_a / name).mkdir()
    yield fs.mount_a / name, fs.mount_b / name
    shutil.rmtree(fs.mount_a / name, ignore_errors=True)


@pytest.fixture
def nodes(root):
    """node A and node B on their own mounts of `root`, started (index scanned)."""
    started = []

    def make(capacity_bytes: int = BIG, start: bool = True) -> tuple[NodeProcess, NodeProcess]:
        a, b = NodeProcess("nodea", root[0], capacity_bytes), NodeProcess("nodeb", root[1], capacity_bytes)
        started.extend((a, b))
        if start:
            a("start"), b("start")
        return a, b

    yield make
    for node in started:
        node.close()


def test_what_a_writes_b_hits_byte_identical(nodes):
    a, b = nodes()

    assert a("write", prefix="k", n=32, tag=1)["written"] == 32

    got = poll(b, "read", lambda r: r["hits"] == 32, prefix="k", n=32)
    assert got["wrong"] == 0
    assert b("stats")["reads"] == 32


def test_both_nodes_writing_the_same_keys_while_both_read_never_get_a_wrong_byte_nor_an_error(nodes):
    a, b = nodes()
    a("write", prefix="r", n=16, tag=1)

    a("race", prefix="r", n=16, tag=1), b("race", prefix="r", n=16, tag=2)
    time.sleep(8)
    races = a("race_end"), b("race_end")

    for race in races:
        assert race["errors"] == [] and race["wrong"] == 0
        assert race["hits"] > 0 and race["written"] > 0
    for node in (a, b):  # no good entry lost for good: once the writes stop, every key is a hit
        poll(node, "read", lambda r: r["hits"] == 16 and r["wrong"] == 0, prefix="r", n=16)


def test_a_clear_and_an_eviction_on_a_while_b_reads(nodes, root, tmp_path):
    a, b = nodes()
    a("write", prefix="c", n=64, tag=1)
    poll(b, "read", lambda r: r["hits"] == 64, prefix="c", n=64)

    b("race", prefix="c", n=64, tag=2, readers=2, write=False)
    a("evict", num_bytes=32 * ENTRY_FILE_BYTES)
    env = hpkv_env(tmp_path / "pool-a", root[0], tmp_path)
    cleared = hpkv(env, "clear", "--storage")
    time.sleep(1)
    race = b("race_end")

    assert cleared.returncode == 0, cleared.stderr
    assert race["errors"] == [] and race["wrong"] == 0 and race["hits"] > 0
    after = poll(b, "read", lambda r: r["hits"] == 0, prefix="c", n=64)  # B's reads miss once the files are gone
    assert after["wrong"] == 0


def test_two_nodes_filling_one_directory_stay_within_the_size_together(nodes, root):
    capacity = 40 * ENTRY_FILE_BYTES
    a, b = nodes(capacity)

    for start in range(0, 120, 20):
        a("write", prefix="fa", n=20, tag=1, start=start)
        b("write", prefix="fb", n=20, tag=2, start=start)
        a("rescan"), b("rescan")

    on_disk = sum(p.stat().st_size for p in root[0].rglob("*.kv"))
    assert on_disk <= capacity, f"{on_disk} bytes on disk, {capacity} allowed"
    assert on_disk >= capacity // 2  # and both still write (each evicts the other's too)
    assert a("stats")["used_bytes"] <= capacity and b("stats")["used_bytes"] <= capacity


def test_b_starts_up_scanning_a_directory_a_is_writing_to(nodes):
    a, b = nodes(start=False)
    a("start")
    a("write", prefix="s", n=64, tag=1)

    a("race", prefix="s2", n=32, tag=1, readers=0)
    started = b("start")
    race = a("race_end")

    assert race["errors"] == []
    assert started["files_scanned"] >= 64 and started["temps_removed"] == 0  # A's live temporaries are A's
    assert b("stats")["untrusted_files"] == 0
    assert poll(b, "read", lambda r: r["hits"] == 32, prefix="s2", n=32)["wrong"] == 0
    assert a("stats")["write_failures"] == 0


def test_lru_across_nodes_spares_a_file_read_on_the_other_node_once_its_mtime_arrives(nodes, root):
    a, b = nodes()
    b("write", prefix="l", n=8, tag=2)
    poll(a, "read", lambda r: r["hits"] == 8, prefix="l", n=8)
    b("age", prefix="l", n=8, age_s=900)  # B last used them 15 minutes ago, the first four the longest
    wait_for(lambda: _age_files(root, 900) or None, 15, 0.2, what="old mtimes")  # and A's last reads too
    file_bytes = _files(root[1], 1)[0].stat().st_size

    assert a("read", prefix="l", n=4)["hits"] == 4  # A reads the first four now: their mtimes move
    recent = lambda: all(time.time() - p.stat().st_mtime < 60 for p in _files(root[1], 4))  # noqa: E731
    wait_for(lambda: recent() or None, 15, 0.1, what="A's reads seen on B's mount")
    b("evict", num_bytes=4 * file_bytes)

    assert b("indexed", prefix="l", n=8)["indexed"] == 4  # the four A read are spared, the next four go
    assert b("read", prefix="l", n=4)["hits"] == 4
    assert a("read", prefix="l", n=4)["hits"] == 4


def _age_files(root: tuple[Path, Path], age_s: float) -> bool:
    """Set the LRU story's files' mtimes `age_s` back through A's mount; whether B's shows it.
    MooseFS sets a file's mtime again when its data lands, up to about a second after its rename."""
    for p in _files(root[0], 8):
        os.utime(p, (time.time() - age_s, time.time() - age_s))
    return all(time.time() - p.stat().st_mtime > age_s - 60 for p in _files(root[1], 8))


def _files(root: Path, n: int) -> list[Path]:
    """The files of the LRU story's first `n` keys, by name (a listing through the other mount may lag)."""
    return [root / NS / k.hex()[:2] / k.hex()[2:4] / f"{k.hex()}.kv" for k in entry_keys(n, "l")]


def test_doctor_checks_the_shared_mount(root, tmp_path):
    env = hpkv_env(tmp_path / "pool", root[0], tmp_path)

    result = hpkv(env, "doctor", "--json")

    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    shared = checks["storage directory: shared by nodes"]
    assert shared["verdict"] == "ok", shared
    assert "storage directory: this node's name" in checks
    assert not [p for p in root[1].iterdir() if p.name.startswith(".doctor-probe")]  # its probes removed
