"""A linear-attention hybrid on real vLLM servers: a tiny random Qwen3-Next (three Gated DeltaNet
layers, one full attention) with vLLM's hybrid KV cache manager on, so its KV cache has a
Mamba-state group per linear layer beside a full-attention group, each cached by HPKV in a
namespace of its own: the attention blocks of a prefix and the recurrent states vLLM keeps at
its block boundaries, loaded together or not at all.

Engines, started as few times as possible: `plain` (vLLM alone, the oracle: its own prefix-cache
hit) and `a` (HPKV, with a load fault on demand); then HPKV restarts under `a` on the same
storage (its DRAM pool gone). Both run with the flags vLLM needs for partial hits of such a
model (states kept every 320 tokens, steps of 320 tokens: `docs/vllm.md`). Every answer must
be exactly (token ids, bit-identical logprobs) what vLLM's own prefix hit gives.
"""

from __future__ import annotations

import re

import pytest

from helpers.storage import kv_files, settled_files
from helpers.vllm import Engine, build_qwen3_next, same_output, start_all, with_load_fault
from helpers.vllm_node import engine_node, restart_server, stop_engines
from helpers.waiting import wait_for
from hpkv.demo.model import prompt_text

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.engine,
    pytest.mark.timeout(1200),
]

# The states vLLM keeps: every STEP tokens, where its scheduler steps end. vLLM raises the block
# size to hold a Mamba state page (96 or 160 tokens on a CPU, by the SSM state's dtype): STEP is
# a multiple of both.
STEP = 480
FLAGS = ("--prefix-cache-retention-interval", str(STEP), "--max-num-batched-tokens", str(STEP))
LONG = prompt_text(1500, seed=201)
OTHER = prompt_text(300, seed=202)
FAILING = prompt_text(1500, seed=203)
SHARED = 1000  # a prompt sharing LONG's first 1000 tokens: a hit up to the state at 960


def block_size(engine: Engine) -> int:
    """The block size vLLM chose ("Setting attention block size to N tokens")."""
    sizes = re.findall(r"Setting attention block size to (\d+) tokens", engine.log_text())
    assert sizes, engine.log_tail()
    return int(sizes[-1])


@pytest.fixture(scope="module")
def model():
    return build_qwen3_next()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    # Every hit loaded: the shared-prefix prompt's (960 tokens) is under the default 1204.
    with engine_node(tmp_path_factory.mktemp("vllm-mamba"), "hpkv-mamba-", {"VLLM_HPKV_TOKEN_THRESHOLD": "0"}) as place:
        yield place


@pytest.fixture(scope="module")
def engines(node, model):
    env = with_load_fault(node.env(), node.root / "shim", node.load_fault)
    a = Engine("qwen3next-a", model, env, node.logs, extra_flags=FLAGS)
    plain = Engine("qwen3next-plain", model, node.no_config, node.logs, hpkv=False, extra_flags=FLAGS)
    try:
        start_all([a, plain])
        yield a, plain
    finally:
        stop_engines(a, plain, shm=node.shm)


@pytest.fixture(scope="module")
def engine_a(engines):
    return engines[0]


@pytest.fixture(scope="module")
def plain(engines):
    return engines[1]


_shared: dict[tuple[int, ...], object] = {}


def shared_reference(plain: Engine, ids: list[int]):
    """vLLM's own hit for `ids` on a cache holding LONG only: the blocks up to its last state
    inside the prefix they share."""
    key = tuple(ids)
    if key not in _shared:
        plain.reset_prefix_cache()
        plain.complete(LONG)
        before = plain.counters()
        _shared[key] = plain.complete(ids)
        assert (plain.counters() - before)["device"] == SHARED // STEP * STEP
    return _shared[key]


def test_vllm_keeps_its_hybrid_manager_with_a_group_per_linear_layer(engine_a):
    text = engine_a.log_text()
    assert "Turning off hybrid kv cache manager" not in text
    assert "HPKV worker rank 0: 1+1+1+1 layers" in text, engine_a.log_tail()


def test_a_prompt_is_served_from_dram_with_its_states(engine_a, plain):
    """Its attention blocks and, at the boundary the hit ends at, every linear layer's state."""
    engine_a.complete(LONG)
    engine_a.reset_prefix_cache()
    before = engine_a.counters()
    answer = engine_a.complete(LONG)
    got = engine_a.counters() - before
    last = (answer.prompt_tokens - 1) // block_size(engine_a) * block_size(engine_a)  # the prompt's checkpoint
    assert got["host"] == last, got.values
    assert got["disk"] == got["device"] == 0, got.values
    assert same_output(answer, plain.reference(LONG))


def test_a_prompt_sharing_a_prefix_hits_up_to_the_last_state_inside_it(engine_a, plain):
    ids = engine_a.tokenize(LONG)[:SHARED] + engine_a.tokenize(OTHER)[:80]
    engine_a.complete(LONG)  # saved (a no-op when it still is)
    engine_a.reset_prefix_cache()
    before = engine_a.counters()
    answer = engine_a.complete(ids)
    got = engine_a.counters() - before
    assert got["host"] == SHARED // STEP * STEP, got.values
    assert same_output(answer, shared_reference(plain, ids))


def test_a_load_that_fails_is_recomputed(engine_a, node, plain):
    """Every group's load fails (the fault zeroes the blocks and states it loads): vLLM hears it
    through failed_recving and recomputes the request; the answer is vLLM's own."""
    engine_a.complete(FAILING)
    engine_a.reset_prefix_cache()
    node.load_fault.touch()
    answer = engine_a.complete(FAILING)
    wait_for(lambda: not node.load_fault.exists(), timeout_s=5, what="the fault to fire")
    assert same_output(answer, plain.reference(FAILING))
    engine_a.reset_prefix_cache()
    assert same_output(engine_a.complete(FAILING), plain.reference(FAILING))


@pytest.fixture(scope="module")
def restarted(node, engine_a):
    """A's HPKV server restarts under it (the DRAM pool goes), on the same storage. (An engine's
    own restart on storage: test_vllm_e2e's B.)"""
    assert kv_files(node.storage), "engine A saved nothing to restart from"
    restart_server(engine_a, node.shm)
    return engine_a


def test_after_a_restart_the_prompt_is_served_from_storage(restarted, plain):
    before = restarted.counters()
    answer = restarted.complete(LONG)
    got = restarted.counters() - before
    assert got["disk"] == (answer.prompt_tokens - 1) // block_size(restarted) * block_size(restarted), got.values
    assert same_output(answer, plain.reference(LONG))


def test_state_namespaces_hold_only_boundary_states(node):
    """Four namespaces (three state groups, one attention group); a state group holds fewer
    entries than the attention group: the states vLLM keeps, not one per block."""
    namespaces = [p for p in node.storage.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(namespaces) == 4, namespaces
    counts = sorted(len(settled_files(ns)) for ns in namespaces)
    assert 0 < counts[0] == counts[2] < counts[3], counts
