"""A real vLLM on each of two nodes joined only by the cluster tier (a real mooncake_master on
127.0.0.1; each node its own host name, HPKV server, pool, segment process and local storage
directory): node A computes a long prompt, and node B's first request for it is a cluster-tier
hit (served as a DRAM hit: vLLM's `host` source), with the output of vLLM's own prefix-cache hit
on A (tokens and logprobs)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from bench.harness.netfs import NodeServer
from helpers.env import without_hpkv
from helpers.mooncake import MooncakeMaster
from helpers.vllm import BLOCK_SIZE, Engine, same_output, start_all, without_hpkv_environ
from hpkv.cluster import segment
from hpkv.demo.model import prompt_text
from hpkv.server.client import Client

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

LONG = prompt_text(1500, seed=34)  # about 1500 tokens: over the documented threshold of 1204


@pytest.fixture(scope="module")
def two_nodes(model, tmp_path_factory):
    work = tmp_path_factory.mktemp("cluster-vllm")
    master = MooncakeMaster(work / "master.log")
    master.start()
    pools = [Path(tempfile.mkdtemp(prefix=f"hpkv-cluster-{n}-", dir="/dev/shm")) for n in "ab"]
    servers: list[NodeServer] = []
    engines: list[Engine] = []
    try:
        for name, pool in zip("ab", pools):
            env = {
                "VLLM_ENABLE_HPKV": "1",
                "HPKV_KV_MEM_POOL_SIZE": "256m",
                "HPKV_SHARE_MEM_FILE_PATH": str(pool),
                "HPKV_KV_STORAGE_PATH": str(work / f"storage-{name}"),  # local to each node
                "HPKV_CONFIG_FILE_PATH": str(work / "no-config.ini"),
                "HPKV_CLUSTER_ENABLE": "1",
                "HPKV_CLUSTER_MASTER": master.address,
                "HPKV_CLUSTER_HOST": "127.0.0.1",
                "HPKV_CLUSTER_SEGMENT_SIZE": "256m",
                "HPKV_CLUSTER_BUFFER_SIZE": "16m",
            }
            servers.append(NodeServer(f"node{name}", {**without_hpkv(), **env}, work / f"server-{name}.log"))
            engines.append(Engine(name, model, env, work))
        with without_hpkv_environ():
            start_all(engines)
        yield engines[0], engines[1], pools
    finally:
        for engine in engines:
            engine.stop()
        for server in servers:
            server.stop()
        for pool in pools:
            segment.stop(pool)
            shutil.rmtree(pool, ignore_errors=True)
        master.stop()


def cluster_stats(pool: Path):
    with Client(pool, kind="test", autostart=False) as client:
        return client.stats().cluster


def test_node_bs_first_request_for_as_prefix_is_a_cluster_hit_with_vllms_own_output(two_nodes):
    a, b, (pool_a, pool_b) = two_nodes
    first = a.complete(LONG)
    reference = a.reference(LONG)  # A's second send: vLLM's own prefix-cache hit
    blocks = first.prompt_tokens // BLOCK_SIZE
    deadline = time.monotonic() + 120
    while cluster_stats(pool_a).objects_written < blocks:  # A's write-through to the cluster
        assert time.monotonic() < deadline, cluster_stats(pool_a)
        time.sleep(0.2)
    before = b.counters()

    answer = b.complete(LONG)  # B never saw this prompt, and shares no storage with A

    got = b.counters() - before
    assert got["host"] > 0 and got["disk"] == 0 and got["device"] == 0
    stats = cluster_stats(pool_b)
    assert stats.hits >= got["host"] // BLOCK_SIZE and stats.bad_objects == 0
    assert same_output(answer, reference)
