"""Hybrid models on real vLLM servers: a tiny random Gemma 3 (a sliding window of 128 tokens on
every other layer) with vLLM's hybrid KV cache manager on, so its KV cache has a sliding-window
group beside a full-attention one, each cached by HPKV in namespaces of its own.

Engines, started as few times as possible: `plain` (vLLM alone, the oracle: its own prefix-cache
hit) and `a` (HPKV, with a load fault on demand); then HPKV restarts under `a` on the same
storage (its DRAM pool gone). Every answer must be exactly (token ids, bit-identical logprobs)
what vLLM's own prefix hit gives, for prompts far longer than the window and for prompts that
diverge from a saved one inside the window.
"""

from __future__ import annotations

import pytest

from helpers.storage import kv_files, settled_files
from helpers.vllm import (
    BLOCK_SIZE,
    GEMMA3_WINDOW,
    Engine,
    build_gemma3,
    kv_cache_tokens,
    same_output,
    start_all,
    with_load_fault,
)
from helpers.vllm_node import engine_node, restart_server, stop_engines
from helpers.waiting import wait_for
from hpkv.demo.model import prompt_text

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.engine,
    pytest.mark.timeout(1200),
]

LONG = prompt_text(1500, seed=101)  # about 1500 tokens: 11 windows
OTHER = prompt_text(300, seed=102)
FAILING = prompt_text(1500, seed=103)
DIVERGE_AT = 1450  # a prompt sharing LONG's first 1450 tokens: it diverges inside the window of its hit


@pytest.fixture(scope="module")
def gemma3():
    return build_gemma3()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with engine_node(tmp_path_factory.mktemp("vllm-hybrid"), "hpkv-hybrid-") as place:
        yield place


@pytest.fixture(scope="module")
def engines(node, gemma3):
    a = Engine("gemma3-a", gemma3, with_load_fault(node.env(), node.root / "shim", node.load_fault), node.logs)
    # vLLM keeps every sliding-window block in its prefix cache (a checkpoint at every block), so
    # its own hit on a prompt sharing part of another can end where HPKV's does.
    plain = Engine(
        "gemma3-plain",
        gemma3,
        node.no_config,
        node.logs,
        hpkv=False,
        extra_flags=("--prefix-cache-retention-interval", str(BLOCK_SIZE)),
    )
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


_shared_hits: dict[tuple[int, ...], tuple] = {}


def shared_reference(plain: Engine, ids: list[int], again: bool = False):
    """vLLM's own prefix hits for `ids`, at the boundaries HPKV's end at, on KV computed as HPKV's
    was: on a reset cache LONG, then `ids` (a hit of the blocks it shares with LONG), then `ids`
    again (a hit of those and of the blocks the first computed); the first answer, or with
    `again` the second. (A window's sum order depends on where a hit ends and on how the KV it
    reads was chunked: a hit ending elsewhere may differ in the last bits.)"""
    key = tuple(ids)
    if key not in _shared_hits:
        plain.reset_prefix_cache()
        plain.complete(LONG)
        before = plain.counters()
        first = plain.complete(ids)
        assert (plain.counters() - before)["device"] == DIVERGE_AT // BLOCK_SIZE * BLOCK_SIZE
        _shared_hits[key] = (first, plain.complete(ids))
    return _shared_hits[key][1 if again else 0]


def _served_again(engine: Engine, prompt):
    """Send, reset vLLM's prefix cache, send again: (the second answer, its counters)."""
    engine.complete(prompt)
    engine.reset_prefix_cache()
    before = engine.counters()
    answer = engine.complete(prompt)
    return answer, engine.counters() - before


def test_vllm_keeps_its_hybrid_manager_and_its_capacity(engine_a, plain):
    """With HPKV the sliding-window layers keep only their window: the engine holds as many
    tokens as without it (with the hybrid manager off it would keep full-length KV)."""
    assert "Turning off hybrid kv cache manager" not in engine_a.log_text()
    assert kv_cache_tokens(engine_a) == kv_cache_tokens(plain)


def test_a_prompt_longer_than_the_window_is_served_from_dram(engine_a, plain):
    answer, got = _served_again(engine_a, LONG)
    assert got["host"] >= 1400 and got["disk"] == got["device"] == 0
    assert same_output(answer, plain.reference(LONG))


def test_a_prompt_diverging_inside_the_window_hits_up_to_its_last_shared_block(engine_a, plain):
    """Its hit ends in the block before the divergence; the window's blocks before that end come
    from HPKV's sliding-window entries, the rest is recomputed."""
    ids = engine_a.tokenize(LONG)[:DIVERGE_AT] + engine_a.tokenize(OTHER)[:80]
    engine_a.complete(LONG)  # saved (a no-op when it still is)
    engine_a.reset_prefix_cache()
    before = engine_a.counters()
    answer = engine_a.complete(ids)
    got = engine_a.counters() - before
    assert got["host"] == DIVERGE_AT // BLOCK_SIZE * BLOCK_SIZE
    assert DIVERGE_AT % BLOCK_SIZE + 80 < GEMMA3_WINDOW  # the divergence is inside the hit's window
    assert same_output(answer, shared_reference(plain, ids))


def test_a_load_that_fails_is_recomputed(engine_a, node, plain):
    """A hybrid model's load fails (every group's, as the fault zeroes the blocks it loads):
    vLLM hears it through failed_recving and recomputes the request; the answer is vLLM's own."""
    engine_a.complete(FAILING)
    engine_a.reset_prefix_cache()
    node.load_fault.touch()
    answer = engine_a.complete(FAILING)
    wait_for(lambda: not node.load_fault.exists(), timeout_s=5, what="the fault to fire")
    assert same_output(answer, plain.reference(FAILING))
    engine_a.reset_prefix_cache()
    again = engine_a.complete(FAILING)
    assert same_output(again, plain.reference(FAILING))


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
    assert got["disk"] >= 1400
    assert same_output(answer, plain.reference(LONG))
    # The diverging prompt again: now HPKV also has the blocks A computed for it past LONG's.
    ids = restarted.tokenize(LONG)[:DIVERGE_AT] + restarted.tokenize(OTHER)[:80]
    restarted.reset_prefix_cache()
    before = restarted.counters()
    answer = restarted.complete(ids)
    got = restarted.counters() - before
    assert got["host"] + got["disk"] == (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert same_output(answer, shared_reference(plain, ids, again=True))


def test_sliding_window_namespaces_hold_every_block(node):
    """Both groups' entries are on storage, one namespace each (a later prefix may end anywhere)."""
    namespaces = [p for p in node.storage.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(namespaces) == 2, namespaces
    counts = sorted(len(settled_files(ns)) for ns in namespaces)
    assert counts[0] == counts[1] > 0
