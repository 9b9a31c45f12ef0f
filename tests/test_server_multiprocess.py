"""Stories of several engine processes sharing one auto-started HPKV Server: TP workers write
through the pool, a second engine reads the same bytes, simultaneous starters make one server, and
the server leaves with its last client while storage keeps the entries for the next one."""

from __future__ import annotations

import time

from helpers.server import Node
from helpers.waiting import wait_for
from hpkv.tiers import Tier

DRAM, STORAGE = int(Tier.DRAM), int(Tier.STORAGE)


def start_engine(node: Node, num_ranks: int = 2):
    """A scheduler and one worker per TP rank, each its own process; the first call auto-starts."""
    scheduler = node.agent("scheduler")
    workers = [node.agent("worker") for _ in range(num_ranks)]
    for rank, worker in enumerate(workers):
        worker.call("register", rank=rank)
    for rank in range(num_ranks):
        scheduler.call("register", rank=rank)
    return scheduler, workers


def test_tp_workers_write_through_the_pool_and_a_second_engine_reads_the_same_bytes(node):
    scheduler, workers = start_engine(node)
    for rank, worker in enumerate(workers):
        saved = worker.call("save", prefix="prompt", n=16, rank=rank)
        assert saved["reserved"] == 16 and saved["committed"] == 16
    for rank in range(2):
        assert scheduler.call("lookup", prefix="prompt", n=20, rank=rank)["tiers"] == [DRAM] * 16
    first_pid = scheduler.call("stats")["server_pid"]

    scheduler_b, workers_b = start_engine(node)
    for rank in range(2):
        assert scheduler_b.call("lookup", prefix="prompt", n=16, rank=rank)["tiers"] == [DRAM] * 16
    for rank, worker in enumerate(workers_b):
        loaded = worker.call("load", prefix="prompt", n=16, rank=rank)
        assert loaded["num_ready"] == 16 and loaded["same"] == [True] * 16

    stats = scheduler_b.call("stats")["stats"]
    assert {a.call("stats")["server_pid"] for a in node.agents} == {first_pid}
    assert node.server_pids() == [first_pid]
    assert sorted(c["kind"] for c in stats["clients"]) == ["scheduler"] * 2 + ["worker"] * 4
    assert stats["store"]["commits"] == 32 and stats["leases"] == 0 and stats["reservations"] == 0


def test_ranks_are_separate_namespaces(node):
    scheduler, workers = start_engine(node)
    workers[0].call("save", prefix="prompt", n=4, rank=0)
    assert scheduler.call("lookup", prefix="prompt", n=4, rank=0)["tiers"] == [DRAM] * 4
    assert scheduler.call("lookup", prefix="prompt", n=4, rank=1)["tiers"] == []


def test_four_processes_starting_at_once_make_exactly_one_server(node):
    starters = [node.agent("worker") for _ in range(4)]
    assert node.server_pids() == []
    for agent in starters:  # all four are ready: send the first call to each without waiting
        agent.send("stats")
    answers = [agent.recv() for agent in starters]
    assert all("error" not in a for a in answers), answers
    pids = {a["stats"]["server"]["pid"] for a in answers}
    assert len(pids) == 1
    assert node.server_pids() == sorted(pids)
    assert node.server_log().count("HPKV server ready") == 1


def test_the_auto_started_server_leaves_with_its_last_client_and_the_next_one_hits_storage(node):
    node.env["HPKV_SERVER_IDLE_EXIT_S"] = "1"
    scheduler, workers = start_engine(node)
    for rank, worker in enumerate(workers):
        assert worker.call("save", prefix="prompt", n=12, rank=rank)["committed"] == 12
    old_pid = scheduler.call("stats")["server_pid"]

    for agent in [scheduler, *workers]:
        agent.exit()
    left_at = time.monotonic()
    node.wait_no_server(timeout_s=1 + 3)
    assert time.monotonic() - left_at >= 0.5  # it lingered for the grace period first
    assert not node.socket_path.exists() and not node.pool_path.exists(), node.server_log()[-3000:]

    scheduler, workers = start_engine(node)
    assert scheduler.call("stats")["server_pid"] != old_pid
    for rank, worker in enumerate(workers):
        assert scheduler.call("lookup", prefix="prompt", n=12, rank=rank)["tiers"] == [STORAGE] * 12
        loaded = worker.call("load", prefix="prompt", n=12, rank=rank)
        assert loaded["num_ready"] == 12 and loaded["same"] == [True] * 12
    # promoted into the new server's DRAM: a second engine now hits memory
    assert scheduler.call("lookup", prefix="prompt", n=12, rank=0)["tiers"] == [DRAM] * 12


def test_a_copying_client_prefaults_the_pool_only_when_asked(node):
    from helpers.mappings import resident_bytes

    node.start_server()
    plain = node.client("scheduler")
    plain.connect()
    copying = node.client("worker", prefault=True)
    copying.connect()
    wait_for(lambda: resident_bytes(copying.region) >= copying.region.size_bytes, what="the pool prefaulted")
    assert resident_bytes(plain.region) == 0
