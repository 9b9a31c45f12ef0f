"""A real vLLM on each of two nodes sharing HPKV's storage tier over GlusterFS (default client
caching) and over MooseFS (`bench.harness.netfs`), one file system after the other: node A
computes a long prompt, and node B, with its own HPKV server, pool and host name and the same
model, gets it from storage, with the output of vLLM's own prefix-cache hit (A's second send of
it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness.netfs import netfs_beds
from helpers.engines import stop_all
from helpers.netfs_engines import netfs_nodes
from helpers.storage import settled_files
from helpers.vllm import BLOCK_SIZE, Engine, same_output, start_all, without_hpkv_environ
from hpkv.demo.model import prompt_text

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

LONG = prompt_text(1500, seed=24)  # about 1500 tokens: over the documented threshold of 1204


@pytest.fixture(scope="module", params=["glusterfs", "moosefs"])
def shared(request):
    """One network file system, mounted twice; the next is set up once this one is torn down."""
    with netfs_beds((request.param,)) as beds:
        bed = beds[request.param]
        if isinstance(bed, str):
            pytest.skip(bed)
        yield bed


@pytest.fixture(scope="module")
def two_nodes(shared, model):
    """Engines A and B, each with its node's HPKV server, on the two mounts of one directory."""
    with netfs_nodes(shared, "hpkv-netfs-vllm-", {"VLLM_ENABLE_HPKV": "1"}) as (nodes, work):
        engines = [Engine(node.name, model, node.env, work) for node in nodes]
        try:
            with without_hpkv_environ():
                start_all(engines)
            yield engines[0], engines[1], shared, work
        finally:
            stop_all(engines)


def landed(fs, work: Path, num_files: int) -> None:
    """Until B's mount shows A's files; if not, what A's mount and A's server show."""
    try:
        settled_files(fs.mount_b / "kv", at_least=num_files, timeout_s=120)
    except AssertionError as exc:
        names = [p.name for p in (fs.mount_a / "kv").rglob("*")]
        kv, tmp = sum(n.endswith(".kv") for n in names), sum(n.endswith(".tmp") for n in names)
        log = (work / "server-a.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"{exc}; A's mount: {kv} KV files, {tmp} temporaries; A's server:\n{log}") from None


def test_what_node_a_computes_node_b_loads_from_storage_with_vllms_own_output(two_nodes):
    a, b, fs, work = two_nodes
    first = a.complete(LONG)
    reference = a.reference(LONG)  # A's second send: vLLM's own prefix-cache hit
    landed(fs, work, first.prompt_tokens // BLOCK_SIZE)  # the prompt's full blocks: what B can hit
    names = {p.name for p in (fs.mount_b / "kv").rglob("*")}
    assert not any(n.endswith(".tmp") for n in names)
    before = b.counters()

    answer = b.complete(LONG)  # B never saw this prompt: its DRAM pool is its own

    got = b.counters() - before
    assert got["disk"] > 0
    assert got["host"] == got["device"] == 0
    assert same_output(answer, reference)
