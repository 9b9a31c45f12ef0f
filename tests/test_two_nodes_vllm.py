"""A real vLLM on each of two nodes, each node with its own HPKV server, pool and host name and the
same model, joined in turn by each way HPKV shares KV across nodes: storage on GlusterFS (default
client caching), storage on MooseFS (`bench.harness.netfs`), and the cluster tier alone (a real
mooncake_master on 127.0.0.1; storage local to each node). In each, node A computes a long prompt
and node B's first request for it is a hit from that path, with the output of vLLM's own
prefix-cache hit (A's second send of it): tokens and logprobs.

One pair of engines serves the three: each scenario (a test's fixture, torn down before the next)
starts the nodes' servers with its settings (`helpers.two_nodes`) and sends prompts of its own."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from bench.harness.netfs import Shared
from helpers.engines import stop_all
from helpers.mooncake import MooncakeMaster
from helpers.storage import settled_files
from helpers.two_nodes import TwoNodes, two_nodes
from helpers.vllm import BLOCK_SIZE, Engine, same_output, start_all, without_hpkv_environ
from hpkv.demo.model import prompt_text
from hpkv.server.client import Client

pytestmark = [pytest.mark.engine, pytest.mark.vllm, pytest.mark.netfs]


def long_prompt(seed: int) -> str:
    return prompt_text(1500, seed=seed)  # about 1500 tokens: over the documented threshold of 1204


@pytest.fixture(scope="module")
def engines(model):
    """Nodes a and b, each with its engine, started against servers with local storage."""
    with two_nodes("hpkv-2n-vllm-") as nodes:
        engines = [
            Engine(name, model, nodes.engine_env(i, {"VLLM_ENABLE_HPKV": "1"}), nodes.work)
            for i, name in enumerate("ab")
        ]
        try:
            local = tuple({"HPKV_KV_STORAGE_PATH": str(nodes.work / f"start-{name}")} for name in "ab")
            with nodes.serve("start", local), without_hpkv_environ():
                start_all(engines)
            yield nodes, engines[0], engines[1]
        finally:
            stop_all(engines)


@pytest.fixture(params=["glusterfs", "moosefs"])
def shared(request, engines, netfs_beds_up):
    """One network file system, mounted twice, node a's server storing in a fresh directory on
    one mount and node b's in the same directory on the other (the bed, its mounts that directory)."""
    nodes = engines[0]
    bed = netfs_beds_up[request.param]
    if isinstance(bed, str):
        pytest.skip(bed)
    mine = Shared(
        bed.name, bed.mount_a / f"two-nodes-vllm-{request.param}", bed.mount_b / f"two-nodes-vllm-{request.param}"
    )
    (mine.mount_a / "kv").mkdir(parents=True)
    mounts = ({"HPKV_KV_STORAGE_PATH": str(mine.mount_a / "kv")}, {"HPKV_KV_STORAGE_PATH": str(mine.mount_b / "kv")})
    try:
        with nodes.serve(request.param, mounts):
            yield mine
    finally:
        shutil.rmtree(mine.mount_a, ignore_errors=True)


def landed(fs, nodes: TwoNodes, scenario: str, num_files: int) -> None:
    """Until B's mount shows A's files; if not, what A's mount and A's server show."""
    try:
        settled_files(fs.mount_b / "kv", at_least=num_files, timeout_s=120)
    except AssertionError as exc:
        names = [p.name for p in (fs.mount_a / "kv").rglob("*")]
        kv, tmp = sum(n.endswith(".kv") for n in names), sum(n.endswith(".tmp") for n in names)
        log = (nodes.work / f"server-{scenario}-a.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"{exc}; A's mount: {kv} KV files, {tmp} temporaries; A's server:\n{log}") from None


def test_what_node_a_computes_node_b_loads_from_storage_with_vllms_own_output(engines, shared, request):
    nodes, a, b = engines
    scenario = request.node.callspec.params["shared"]
    prompt = long_prompt(seed=24 if scenario == "glusterfs" else 25)
    first = a.complete(prompt)
    reference = a.reference(prompt)  # A's second send: vLLM's own prefix-cache hit
    landed(shared, nodes, scenario, first.prompt_tokens // BLOCK_SIZE)  # its full blocks: what B can hit
    names = {p.name for p in (shared.mount_b / "kv").rglob("*")}
    assert not any(n.endswith(".tmp") for n in names)
    before = b.counters()

    answer = b.complete(prompt)  # B never saw this prompt: its DRAM pool is its own

    got = b.counters() - before
    assert got["disk"] > 0
    assert got["host"] == got["device"] == 0
    assert same_output(answer, reference)


# -- the cluster tier -------------------------------------------------------------------------


@pytest.fixture
def cluster(engines):
    """A master, and node a's and node b's servers in its cluster tier, storage local to each."""
    nodes = engines[0]
    master = MooncakeMaster(nodes.work / "master.log")
    master.start()
    tier = {
        "HPKV_CLUSTER_ENABLE": "1",
        "HPKV_CLUSTER_MASTER": master.address,
        "HPKV_CLUSTER_HOST": "127.0.0.1",
        "HPKV_CLUSTER_SEGMENT_SIZE": "256m",
        "HPKV_CLUSTER_BUFFER_SIZE": "16m",
    }
    local = tuple({**tier, "HPKV_KV_STORAGE_PATH": str(nodes.work / f"cluster-{name}")} for name in "ab")
    try:
        with nodes.serve("cluster", local):
            yield
    finally:
        master.stop()


def cluster_stats(pool: Path):
    with Client(pool, kind="test", autostart=False) as client:
        return client.stats().cluster


def test_node_bs_first_request_for_as_prefix_is_a_cluster_hit_with_vllms_own_output(engines, cluster):
    nodes, a, b = engines
    prompt = long_prompt(seed=34)
    first = a.complete(prompt)
    reference = a.reference(prompt)  # A's second send: vLLM's own prefix-cache hit
    blocks = first.prompt_tokens // BLOCK_SIZE
    deadline = time.monotonic() + 120
    while cluster_stats(nodes.pools[0]).objects_written < blocks:  # A's write-through to the cluster
        assert time.monotonic() < deadline, cluster_stats(nodes.pools[0])
        time.sleep(0.2)
    before = b.counters()

    answer = b.complete(prompt)  # B never saw this prompt, and shares no storage with A

    got = b.counters() - before
    assert got["host"] > 0 and got["disk"] == 0 and got["device"] == 0
    stats = cluster_stats(nodes.pools[1])
    assert stats.hits >= got["host"] // BLOCK_SIZE and stats.bad_objects == 0
    assert same_output(answer, reference)
