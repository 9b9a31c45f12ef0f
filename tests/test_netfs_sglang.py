"""A real serving SGLang with `--enable-ct-hpkv` on each of two nodes sharing HPKV's storage tier
over GlusterFS (default client caching; `bench.harness.netfs`): node A computes a long prompt,
and node B, with its own HPKV server, pool and host name and the same model, gets it from
storage, with the output of SGLang's own device-cache hit (A's second send, before anything was
loaded from HPKV). Where B's hit came from: the response's `meta_info.cached_tokens_details`
and B's HPKV server's counters (storage-tier hits).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from bench.harness.engine import start_together
from bench.harness.netfs import netfs_beds
from helpers import sglang_serving as ss
from helpers.engines import stop_all
from helpers.netfs_engines import netfs_nodes
from helpers.server import server_stats
from helpers.storage import settled_files
from hpkv.demo.model import build_model, prompt_text

pytestmark = pytest.mark.engine

LONG = prompt_text(2000, seed=2424)  # about 2000 tokens: above the documented threshold of 1204


@pytest.fixture(scope="module")
def gluster():
    ss.require_sglang_venv()
    with netfs_beds(("glusterfs",)) as beds:
        bed = beds["glusterfs"]
        if isinstance(bed, str):
            pytest.skip(bed)
        yield bed


@pytest.fixture(scope="module")
def two_nodes(gluster):
    """SGLang A and B, each with its node's HPKV server, on the two mounts of one directory."""
    model = build_model(Path(tempfile.gettempdir()) / f"hpkv-sglang-model-{os.getuid()}")
    with netfs_nodes(gluster, "hpkv-netfs-sglang-") as (nodes, work):
        engines = [ss.SglangEngine(node.name, model, node.env, work) for node in nodes]
        try:
            start_together(engines)  # two overlap well on two cores
            yield engines[0], engines[1], gluster, nodes[1].pool
        finally:
            stop_all(engines)


def test_what_node_a_computes_sglang_on_node_b_loads_from_storage_with_sglangs_own_output(two_nodes):
    a, b, fs, b_pool = two_nodes
    cold = a.complete(LONG)
    assert cold.cached["total"] == 0, cold.cached
    reference = a.complete(LONG)  # SGLang's own device-cache hit
    assert reference.cached.get("device", 0) > 0, reference.cached
    pages = ss.full_pages(reference.prompt_tokens) // ss.PAGE_SIZE
    a.wait_backed_up(pages * ss.PAGE_SIZE)
    settled_files(fs.mount_b / "kv", at_least=pages, timeout_s=120)

    hit = b.complete(LONG)  # B never saw this prompt: its DRAM pool is its own

    assert hit.cached.get("storage") == pages * ss.PAGE_SIZE, hit.cached
    assert hit.cached.get("storage_backend") == "HpkvStorage", hit.cached
    assert hit.cached.get("device", 0) == 0 and hit.cached.get("host", 0) == 0, hit.cached
    assert ss.same_output(hit, reference), (hit, reference)
    stats = server_stats(b_pool)  # B's own HPKV server read them from its storage tier
    assert stats is not None
    assert sum(ns.hit_keys_storage for ns in stats.namespaces.values()) >= pages
