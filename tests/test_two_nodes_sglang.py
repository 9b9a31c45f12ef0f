"""A real serving SGLang with `--enable-ct-hpkv` on each of two nodes, each node with its own HPKV
server, pool and host name and the same model, joined in turn by storage on GlusterFS (default
client caching; `bench.harness.netfs`) and by the cluster tier alone (a real mooncake_master on
127.0.0.1; storage local to each node). In each, node A computes a long prompt and node B's first
request for it loads it through HPKV (SGLang's `storage` source, `HpkvStorage`), with the output
of SGLang's own device-cache hit on A (A's second send, before anything was loaded from HPKV).
Where B's hit came from: the response's `meta_info.cached_tokens_details` and B's server's
counters (storage-tier hits, cluster-tier hits).

One pair of engines serves both: each scenario (a test's fixture, torn down before the next)
starts the nodes' servers with its settings (`helpers.two_nodes`) and sends prompts of its own."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from bench.harness.engine import start_together
from bench.harness.netfs import Shared
from helpers import sglang_serving as ss
from helpers.engines import stop_all
from helpers.mooncake import MooncakeMaster
from helpers.server import server_stats
from helpers.storage import settled_files
from helpers.two_nodes import two_nodes
from hpkv.demo.model import build_model, prompt_text

pytestmark = [pytest.mark.engine, pytest.mark.sglang, pytest.mark.netfs]


def long_prompt(seed: int) -> str:
    return prompt_text(2000, seed=seed)  # about 2000 tokens: above the documented threshold of 1204


@pytest.fixture(scope="module")
def engines():
    """Nodes a and b, each with its SGLang, started against servers with local storage."""
    ss.require_sglang_venv()
    model = build_model(Path(tempfile.gettempdir()) / f"hpkv-sglang-model-{os.getuid()}")
    with two_nodes("hpkv-2n-sglang-") as nodes:
        engines = [ss.SglangEngine(name, model, nodes.engine_env(i), nodes.work) for i, name in enumerate("ab")]
        try:
            local = tuple({"HPKV_KV_STORAGE_PATH": str(nodes.work / f"start-{name}")} for name in "ab")
            with nodes.serve("start", local):
                start_together(engines)  # two overlap well on two cores
            yield nodes, engines[0], engines[1]
        finally:
            stop_all(engines)


def loaded_from_hpkv(a: ss.SglangEngine, b: ss.SglangEngine, prompt: str, landed) -> tuple[int, object]:
    """A computes `prompt`, takes SGLang's own device-cache hit as the reference and backs the
    pages up; once `landed(pages)` returns, B's first send of it: (pages, B's answer), B's answer
    loaded through HPKV with the reference's output."""
    cold = a.complete(prompt)
    assert cold.cached["total"] == 0, cold.cached
    reference = a.complete(prompt)  # SGLang's own device-cache hit
    assert reference.cached.get("device", 0) > 0, reference.cached
    pages = ss.full_pages(reference.prompt_tokens) // ss.PAGE_SIZE
    a.wait_backed_up(pages * ss.PAGE_SIZE)
    landed(pages)

    hit = b.complete(prompt)  # B never saw this prompt: its DRAM pool is its own

    assert hit.cached.get("storage") == pages * ss.PAGE_SIZE, hit.cached
    assert hit.cached.get("storage_backend") == "HpkvStorage", hit.cached
    assert hit.cached.get("device", 0) == 0 and hit.cached.get("host", 0) == 0, hit.cached
    assert ss.same_output(hit, reference), (hit, reference)
    return pages, hit


@pytest.fixture
def gluster(engines, netfs_beds_up):
    """GlusterFS mounted twice, node a's server storing in a fresh directory on one mount and node
    b's in the same directory on the other (the bed, its mounts that directory)."""
    nodes = engines[0]
    bed = netfs_beds_up["glusterfs"]
    if isinstance(bed, str):
        pytest.skip(bed)
    mine = Shared(bed.name, bed.mount_a / "two-nodes-sglang", bed.mount_b / "two-nodes-sglang")
    (mine.mount_a / "kv").mkdir(parents=True)
    mounts = ({"HPKV_KV_STORAGE_PATH": str(mine.mount_a / "kv")}, {"HPKV_KV_STORAGE_PATH": str(mine.mount_b / "kv")})
    try:
        with nodes.serve("glusterfs", mounts):
            yield mine
    finally:
        shutil.rmtree(mine.mount_a, ignore_errors=True)


def test_what_node_a_computes_sglang_on_node_b_loads_from_storage_with_sglangs_own_output(engines, gluster):
    nodes, a, b = engines
    before = server_stats(nodes.pools[1])
    assert before is not None

    def landed(pages: int) -> None:
        settled_files(gluster.mount_b / "kv", at_least=pages, timeout_s=120)

    pages, _ = loaded_from_hpkv(a, b, long_prompt(seed=2424), landed)

    stats = server_stats(nodes.pools[1])  # B's own HPKV server read them from its storage tier
    assert stats is not None
    hits = sum(ns.hit_keys_storage for ns in stats.namespaces.values())
    assert hits - sum(ns.hit_keys_storage for ns in before.namespaces.values()) >= pages


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


def test_sglang_on_node_b_loads_what_node_a_computed_from_the_cluster_tier(engines, cluster):
    nodes, a, b = engines

    def written(pages: int) -> None:  # A's write-through to the cluster
        deadline = time.monotonic() + 120
        while (s := server_stats(nodes.pools[0])) is None or s.cluster is None or s.cluster.objects_written < pages:
            assert time.monotonic() < deadline, s and s.cluster
            time.sleep(0.2)

    pages, _ = loaded_from_hpkv(a, b, long_prompt(seed=3434), written)

    b_stats = server_stats(nodes.pools[1])
    assert b_stats is not None and b_stats.cluster is not None
    assert b_stats.cluster.hits >= pages and b_stats.cluster.bad_objects == 0
    assert sum(ns.hit_keys_storage for ns in b_stats.namespaces.values()) == 0  # not from B's own files
