"""Two and four nodes sharing one storage directory as a cluster (HPKV_KV_STORAGE_CLUSTER=on) over
real network file systems: GlusterFS with its default client caching, and MooseFS, each mounted
twice on this machine (`bench.harness.netfs`; nodes alternate between the two mounts). Each node
is a process with its own host name and a real `StorageTier` (`helpers.netfs_node`), with a
lease of LEASE_S so that a takeover fits in a test. The stories: what one node writes every
other reads; the nodes hold the capacity together, each evicting only in its own parts; a node
killed -9 has its parts taken over within the protocol's bound, and no file is evicted twice
(no unlink finds its file gone) or leaked (every file written is on disk or unlinked once)."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest

from bench.harness.netfs import Shared
from helpers.netfs_node import ENTRY_BYTES
from helpers.netfs_nodes import NodeProcess, poll
from helpers.waiting import wait_for
from hpkv.storage.members import Timing
from hpkv.storage.parts import PARTS

LEASE_S = 6.0
TIMING = Timing(LEASE_S)
SLACK_S = 10.0  # a loaded two-core machine: ticks every second, passes and answers late


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
    """A fresh storage directory on the shared file system: (A's mount's path, B's)."""
    name = f"c-{uuid.uuid4().hex[:8]}"
    (fs.mount_a / name).mkdir()
    yield fs.mount_a / name, fs.mount_b / name
    shutil.rmtree(fs.mount_a / name, ignore_errors=True)


@pytest.fixture
def cluster(root):
    """`make(n, capacity)`: n started nodes in a cluster, every one seeing all and holding its parts."""
    started: list[NodeProcess] = []

    def make(n: int, capacity_bytes: int) -> list[NodeProcess]:
        for i in range(n):
            node = NodeProcess(f"node{i}", root[i % 2], capacity_bytes, cluster="on", lease_s=LEASE_S)
            started.append(node)
            node("start")
        for node in started:
            poll(
                node, "cluster", lambda c: c["live"] == n and c["evictable"] == c["owned"], TIMING.takeover_s + SLACK_S
            )
        return list(started)

    yield make
    for node in started:
        if node.proc.poll() is None:
            node.close()


def on_disk(root: Path) -> tuple[int, int]:
    """(files, bytes) of entry files under the root."""
    sizes = []
    for p in root.glob("*/*/*/*.kv"):
        try:
            sizes.append(p.stat().st_size)
        except FileNotFoundError:  # evicted since the listing (the nodes' own threads pass too)
            pass
    return len(sizes), sum(sizes)


def pass_until_within(nodes: list[NodeProcess], root: Path, capacity: int) -> tuple[int, int]:
    """Every node passes over its parts until the root holds at most `capacity` (a directory's new
    mtime, and new names, reach the other mount up to ~1 s late)."""

    def within() -> tuple[int, int] | None:
        for node in nodes:
            node("pass")
        files, size = on_disk(root)
        return (files, size) if size <= capacity else None

    try:
        return wait_for(within, 30, 0.5, what="the root within its capacity")
    except AssertionError as exc:
        states = [{k: v for k, v in node("cluster").items() if k != "usage"} for node in nodes]
        raise AssertionError(f"{exc}: {on_disk(root)} on disk, {capacity} bytes allowed; nodes {states}") from None


def counted(nodes: list[NodeProcess], root: Path) -> tuple[int, list[dict]]:
    """(files on disk, each node's state), taken while no node unlinked anything (their own
    threads pass too)."""

    def still() -> tuple[int, list[dict]] | None:
        before = [node("cluster") for node in nodes]
        files, _ = on_disk(root)
        after = [node("cluster") for node in nodes]
        same = [b["unlinked"] for b in before] == [a["unlinked"] for a in after]
        return (files, after) if same else None

    return wait_for(still, 30, 0.2, what="a moment with no unlink")


@pytest.mark.parametrize("n", [2, 4])
def test_what_one_node_writes_every_other_reads_and_all_hold_the_capacity_together(cluster, root, n):
    capacity = 60 * (ENTRY_BYTES + 4096)
    nodes = cluster(n, capacity)
    for i, node in enumerate(nodes):
        assert node("write", prefix=f"w{i}", n=10, tag=1)["written"] == 10
    for i, _writer in enumerate(nodes):
        for reader in nodes:
            got = poll(reader, "read", lambda r: r["hits"] == 10, prefix=f"w{i}", n=10)
            assert got["wrong"] == 0

    written = 10 * n
    for round_ in range(3):
        for i, node in enumerate(nodes):
            written += node("write", prefix=f"f{i}", n=15, tag=1, start=15 * round_)["written"]
    _, size = pass_until_within(nodes, root[0], capacity)

    files, states = counted(nodes, root[0])
    assert sum(s["owned"] for s in states) == PARTS
    assert size >= capacity // 2  # and each owner still holds its share
    assert sum(s["unlink_absent"] for s in states) == 0  # no file evicted twice
    assert written == files + sum(s["unlinked"] for s in states)  # none leaked
    assert states[0]["usage"]["owners"] == n


@pytest.mark.parametrize("n", [2, 4])
def test_a_node_killed_has_its_parts_taken_over_within_the_lease_and_nothing_is_evicted_twice(cluster, root, n):
    capacity = 40 * (ENTRY_BYTES + 4096)
    nodes = cluster(n, capacity)
    written = sum(node("write", prefix=f"k{i}", n=8, tag=1)["written"] for i, node in enumerate(nodes))
    dead, alive = nodes[-1], nodes[:-1]
    unlinked_by_dead = dead("cluster")["unlinked"]
    dead.kill()
    killed = time.monotonic()

    for node in alive:
        poll(
            node,
            "cluster",
            lambda c: c["live"] == n - 1 and c["evictable"] == c["owned"],
            TIMING.takeover_s + SLACK_S,
        )
    took_s = time.monotonic() - killed
    states = [node("cluster") for node in alive]
    assert sum(s["owned"] for s in states) == PARTS  # every part has a live owner again
    assert took_s <= TIMING.takeover_s + SLACK_S

    for round_ in range(3):
        for i, node in enumerate(alive):
            written += node("write", prefix=f"m{i}", n=10, tag=1, start=10 * round_)["written"]
    pass_until_within(alive, root[0], capacity)

    files, states = counted(alive, root[0])
    assert sum(s["unlink_absent"] for s in states) == 0
    assert written == files + unlinked_by_dead + sum(s["unlinked"] for s in states)
    leases = lambda: len(list((root[0] / "cluster" / "members").iterdir()))  # noqa: E731
    wait_for(lambda: leases() == n - 1 or None, TIMING.takeover_s + SLACK_S, 0.5, what="the dead lease reaped")
