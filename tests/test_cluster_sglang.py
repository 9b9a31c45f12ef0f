"""A real serving SGLang with `--enable-ct-hpkv` on each of two nodes joined only by the cluster
tier (a real mooncake_master on 127.0.0.1; each node its own host name, HPKV server, pool, segment
process and local storage directory): node A computes a long prompt, and node B's first request
for it loads it through HPKV (SGLang's `storage` source, `HpkvStorage`), which B's server read
from the cluster tier, with the output of SGLang's own device-cache hit on A."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from bench.harness.engine import start_together
from bench.harness.netfs import NodeServer
from helpers import sglang_serving as ss
from helpers.env import without_hpkv
from helpers.mooncake import MooncakeMaster
from helpers.server import server_stats
from hpkv.cluster import segment
from hpkv.demo.model import build_model, prompt_text

pytestmark = [
    pytest.mark.engine,
]

LONG = prompt_text(2000, seed=3434)  # about 2000 tokens: above the documented threshold of 1204


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    ss.require_sglang_venv()
    model = build_model(Path(tempfile.gettempdir()) / f"hpkv-sglang-model-{os.getuid()}")
    work = tmp_path_factory.mktemp("cluster-sglang")
    master = MooncakeMaster(work / "master.log")
    master.start()
    pools = [Path(tempfile.mkdtemp(prefix=f"hpkv-cluster-{n}-", dir="/dev/shm")) for n in "ab"]
    servers: list[NodeServer] = []
    engines: list[ss.SglangEngine] = []
    try:
        for name, pool in zip("ab", pools):
            env = {
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
            engines.append(ss.SglangEngine(name, model, env, work))
        start_together(engines)
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


def test_sglang_on_node_b_loads_what_node_a_computed_from_the_cluster_tier(two_nodes):
    a, b, (pool_a, pool_b) = two_nodes
    cold = a.complete(LONG)
    assert cold.cached["total"] == 0, cold.cached
    reference = a.complete(LONG)  # SGLang's own device-cache hit
    assert reference.cached.get("device", 0) > 0, reference.cached
    pages = ss.full_pages(reference.prompt_tokens) // ss.PAGE_SIZE
    a.wait_backed_up(pages * ss.PAGE_SIZE)
    deadline = time.monotonic() + 120
    while (stats := server_stats(pool_a)) is None or stats.cluster is None or stats.cluster.objects_written < pages:
        assert time.monotonic() < deadline, stats and stats.cluster
        time.sleep(0.2)

    hit = b.complete(LONG)  # B never saw this prompt, and shares no storage with A

    assert hit.cached.get("storage") == pages * ss.PAGE_SIZE, hit.cached
    assert hit.cached.get("storage_backend") == "HpkvStorage", hit.cached
    assert ss.same_output(hit, reference), (hit, reference)
    b_stats = server_stats(pool_b)
    assert b_stats is not None and b_stats.cluster is not None
    assert b_stats.cluster.hits >= pages and b_stats.cluster.bad_objects == 0
    assert sum(ns.hit_keys_storage for ns in b_stats.namespaces.values()) == 0  # not from B's own files
