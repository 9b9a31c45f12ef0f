"""Two HPKV servers as two nodes (own pool directories, own storage directories, nothing shared
but a real mooncake_master on 127.0.0.1): what node A's engine saved, node B's engine loads from
the cluster tier, byte for byte, served as DRAM hits; A's server dying keeps A's share (its
segment lives in a process of its own); that process killed -9, and the master killed and
restarted, are misses, never an error or a wrong byte, and hits come back by themselves."""

from __future__ import annotations

import time

import pytest

from helpers.mooncake import mooncake_master  # noqa: F401  (a fixture)
from helpers.processes import alive, kill
from helpers.server import Node
from hpkv.cluster import segment

DRAM = 1


def cluster_env(master) -> dict[str, str]:
    return {
        "HPKV_CLUSTER_ENABLE": "1",
        "HPKV_CLUSTER_MASTER": master.address,
        "HPKV_CLUSTER_HOST": "127.0.0.1",
        "HPKV_CLUSTER_SEGMENT_SIZE": "64m",
        "HPKV_CLUSTER_BUFFER_SIZE": "16m",
    }


@pytest.fixture
def two_nodes(mooncake_master, tmp_path_factory):
    from conftest import _fresh_shm_dir

    made = []
    shm = [_fresh_shm_dir("hpkv-cluster-") for _ in range(2)]
    for name, gen in zip("ab", shm):
        node = Node(next(gen), tmp_path_factory.mktemp(f"node-{name}"), **cluster_env(mooncake_master))
        node.start_server()
        made.append(node)
    yield made
    for node in made:
        node.close()
        segment.stop(node.shm_dir)
    for gen in shm:
        next(gen, None)


def wait_for(check, timeout_s: float = 60.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def engine(node: Node):
    agent = node.agent("scheduler")
    agent.call("register")
    return agent


def test_what_node_a_saved_node_b_loads_from_the_cluster_byte_for_byte(two_nodes):
    a_node, b_node = two_nodes
    a, b = engine(a_node), engine(b_node)
    assert a.call("save", prefix="p", n=16)["committed"] == 16
    wait_for(lambda: b.call("lookup", prefix="p", n=18)["tiers"] == [DRAM] * 16, what="B never hit A's prefix")
    loaded = b.call("load", prefix="p", n=16)
    assert loaded["num_ready"] == 16 and loaded["same"] == [True] * 16
    cluster = b.call("stats")["stats"]["cluster"]
    assert cluster["hits"] == 16 and cluster["bad_objects"] == 0 and cluster["reachable"]
    assert cluster["segment_pid"] and alive(cluster["segment_pid"])
    assert a.call("stats")["stats"]["cluster"]["objects_written"] == 16
    assert not [f for f in b_node.storage_dir.rglob("*") if f.is_file() and f.name != "namespace.json"]
    # `hpkv clear --memory` of the namespace on B: B's DRAM entries and the cluster's objects go.
    ns = b.call("register")["ns"]
    cleared = b_node.client().clear(dram=True, ns=ns)
    assert cleared.dram == 16
    assert b.call("lookup", prefix="p", n=16)["tiers"] == []
    assert a.call("lookup", prefix="p", n=16)["tiers"] == [DRAM] * 16  # A's own DRAM keeps them


def test_a_nodes_share_outlives_its_server_and_its_death_is_misses_without_wrong_bytes(two_nodes):
    a_node, b_node = two_nodes
    a, b = engine(a_node), engine(b_node)
    for prefix in ("q", "r"):
        assert a.call("save", prefix=prefix, n=24)["committed"] == 24
    wait_for(lambda: a.call("stats")["stats"]["cluster"]["objects_written"] == 48, what="A's writes")
    a_segment = a.call("stats")["stats"]["cluster"]["segment_pid"]
    for pid in a_node.server_pids():  # A's server dies (an idle exit, a crash): its share stays
        kill(pid)
    a.kill()
    assert alive(a_segment)
    assert b.call("lookup", prefix="q", n=24)["tiers"] == [DRAM] * 24
    assert b.call("load", prefix="q", n=24)["same"] == [True] * 24
    kill(a_segment)  # now A's share goes (objects also placed in B's own segment stay)
    deadline, fewest, quarantined = time.monotonic() + 20, 24, 0
    while time.monotonic() < deadline:  # every lookup answers, in bounded time; what loads is right
        t0 = time.monotonic()
        num = len(b.call("lookup", prefix="r", n=24)["tiers"])
        fewest = min(fewest, num)
        assert time.monotonic() - t0 < 5.0
        # The lease asks the cluster again: a dying segment may answer it otherwise than the
        # lookup before; what it says is ready is leased, and is right.
        loaded = b.call("load", prefix="r", n=24)
        assert loaded["num_ready"] == loaded["num_leased"] and all(loaded["same"])
        quarantined = max(quarantined, b.call("stats")["stats"]["quarantined"])
        time.sleep(0.5)
    assert fewest < 24  # A's share did go (Mooncake placed each object in A's segment or B's)
    assert quarantined > 0  # slots whose reads failed in transfer were kept from reuse a while
    assert b.call("stats")["stats"]["cluster"]["bad_objects"] == 0


def test_the_master_killed_and_restarted_is_misses_then_hits_again_by_themselves(two_nodes, mooncake_master):
    a_node, b_node = two_nodes
    a, b = engine(a_node), engine(b_node)
    assert a.call("save", prefix="s", n=8)["committed"] == 8
    wait_for(lambda: a.call("stats")["stats"]["cluster"]["objects_written"] == 8, what="A's writes")
    mooncake_master.kill()
    for _ in range(3):  # bounded: HPKV_CLUSTER_TIMEOUT_S, then the breaker skips the tier
        t0 = time.monotonic()
        assert b.call("lookup", prefix="s", n=8)["tiers"] == []
        assert time.monotonic() - t0 < 2.5
    assert a.call("save", prefix="t", n=8)["committed"] == 8  # saves go on, into DRAM and storage
    assert b.call("stats")["stats"]["cluster"]["breaker_open"]
    mooncake_master.start()  # with no key: Mooncake keeps none across a restart
    # Entries saved while a node's breaker is open are not written to the cluster (they stay in
    # its DRAM and storage): A saves new prefixes until one reaches B.
    deadline, i = time.monotonic() + 90, 0
    while True:
        i += 1
        assert a.call("save", prefix=f"u{i}", n=8)["committed"] == 8
        a.call("stats")
        time.sleep(0.5)
        if b.call("lookup", prefix=f"u{i}", n=8)["tiers"] == [DRAM] * 8:
            break
        assert time.monotonic() < deadline, "B never hit again after the master came back"
    assert b.call("load", prefix=f"u{i}", n=8)["same"] == [True] * 8


def test_status_doctor_and_metrics_show_the_tier(two_nodes, mooncake_master):
    import json

    from helpers.cli import free_port, hpkv
    from test_metrics import scrape

    a_node, b_node = two_nodes
    a = engine(a_node)
    a.call("save", prefix="m", n=4)
    wait_for(lambda: a.call("stats")["stats"]["cluster"]["objects_written"] == 4, what="A's writes")
    status = hpkv({**a_node.env, "COLUMNS": "400"}, "status")
    assert status.returncode == 0, status.stderr
    row = next(line for line in status.stdout.splitlines() if line.startswith("│ cluster "))
    assert mooncake_master.address in row and "reachable" in row and "64.0 MiB" in row
    checks = {c["name"]: c for c in json.loads(hpkv(a_node.env, "doctor", "--json").stdout)["checks"]}
    for name in ("cluster libraries", "cluster master", "cluster protocol", "cluster segment"):
        assert checks[name]["verdict"] == "ok", checks[name]
    assert checks["cluster address"]["verdict"] == "ok"  # loopback, like the master: one machine
    rdma = {
        c["name"]: c
        for c in json.loads(hpkv({**a_node.env, "HPKV_CLUSTER_PROTOCOL": "rdma"}, "doctor", "--json").stdout)["checks"]
    }
    assert (
        rdma["cluster protocol"]["verdict"] == "fail" and "HPKV_CLUSTER_PROTOCOL=tcp" in rdma["cluster protocol"]["fix"]
    )
    # Metrics: a server with the tier exports it (one without exports zeros: test_grafana_dashboard.py).
    port = free_port()
    b_node.close()
    b_node.start_server(HPKV_METRICS_PORT=str(port))
    b = engine(b_node)
    a.call("save", prefix="m2", n=4)
    wait_for(lambda: b.call("lookup", prefix="m2", n=4)["tiers"] == [DRAM] * 4, what="B's hits", timeout_s=90)
    samples = scrape(port)
    assert samples[("hpkv_cluster_enabled", ())] == 1 and samples[("hpkv_cluster_hits_total", ())] == 4
    assert samples[("hpkv_cluster_read_bytes_total", ())] > 0 and samples[("hpkv_cluster_reachable", ())] == 1
    mooncake_master.kill()
    down = {c["name"]: c for c in json.loads(hpkv(a_node.env, "doctor", "--json").stdout)["checks"]}
    assert down["cluster master"]["verdict"] == "fail" and "mooncake_master" in down["cluster master"]["fix"]


def test_hpkv_cluster_start_and_stop_the_nodes_segment_process(mooncake_master, pool_dir, tmp_path):
    from helpers.cli import hpkv, hpkv_env

    env = hpkv_env(pool_dir, tmp_path / "storage", tmp_path, **cluster_env(mooncake_master))
    try:
        first = hpkv(env, "cluster", "start")
        assert first.returncode == 0 and "started: 64.0 MiB" in first.stdout, first.stdout + first.stderr
        pid = segment.running(pool_dir)
        assert pid and alive(pid)
        again = hpkv(env, "cluster", "start")
        assert f"segment process {pid} already running" in again.stdout
        stopped = hpkv(env, "cluster", "stop")
        assert "stopped" in stopped.stdout and not alive(pid) and segment.running(pool_dir) is None
        assert "no segment process runs" in hpkv(env, "cluster", "stop").stdout
        off = hpkv({**env, "HPKV_CLUSTER_ENABLE": "0"}, "cluster", "start")
        assert off.returncode != 0 and "HPKV_CLUSTER_ENABLE=1" in off.stderr
    finally:
        segment.stop(pool_dir)
