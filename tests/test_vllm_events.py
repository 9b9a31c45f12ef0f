"""KV events of HPKV's tiers (issue 35), on real vLLM servers with `--kv-events-config` and a
subscriber decoding with vLLM's own event classes (`helpers.kvevents`).

One node, one HPKV server with a small DRAM pool (a few prompts' worth), two engines of the same
tiny model under two model identities (so: two sets of namespaces), started once for the module
and walked in order: a long prompt announced for the device, HPKV's DRAM pool ("CPU") and
storage ("STORAGE") with vLLM's own payload; /reset_prefix_cache takes the device's and leaves
HPKV's; prompts past the pool's size evict, `hpkv clear --memory` empties the pool, `hpkv clear
--storage` the storage tier, each announced within the documented bound; at the end each
subscriber's index per tier is what the server's tiers hold, and neither engine published a
block of the other's namespaces; last, engine a restarts on the same server (b keeps it up) and
announces what HPKV's tiers hold of its namespaces before any request reaches it. Block hashes are published as bytes
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), so they are compared with the server's keys exactly.
"""

from __future__ import annotations

import os
import time

import pytest

from helpers.cli import hpkv
from helpers.kvevents import Subscriber
from helpers.server import server_pid, server_stats
from helpers.vllm import BLOCK_SIZE, Engine, start_all
from helpers.vllm_node import engine_node, stop_engines
from helpers.waiting import wait_for
from hpkv.demo.model import prompt_text
from hpkv.server.client import Client

pytestmark = [pytest.mark.engine, pytest.mark.vllm, pytest.mark.timeout(1200)]

POOL = "4m"  # about 200 blocks of the test model (16 KiB each): a few long prompts' worth
BOUND_S = 1.0  # docs/vllm.md: a tier's change is published within 0.1 s plus one engine step
CPU, STORAGE, GPU = "CPU", "STORAGE", "GPU"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-events")
    extra = {"HPKV_KV_MEM_POOL_SIZE": POOL, "VLLM_HPKV_TOKEN_THRESHOLD": "0"}
    with engine_node(root, "hpkv-events-", extra_env=extra) as place:
        yield place


@pytest.fixture(scope="module")
def engines(node, model):
    """(engine, its subscriber, its model identity) for a and b, sharing the node's server."""
    pairs = []
    for name in ("a", "b"):
        sub = Subscriber()
        env = {**node.env(), "HPKV_MODEL_ID": f"events-{name}", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}
        engine = Engine(name, model, env, node.logs, extra_flags=("--kv-events-config", sub.flag()))
        pairs.append((engine, sub, f"events-{name}"))
    try:
        start_all([engine for engine, _, _ in pairs])
        yield pairs
    finally:
        stop_engines(*(engine for engine, _, _ in pairs), shm=node.shm)
        for _, sub, _ in pairs:
            sub.close()


def server_view(node, model_id: str, hashes) -> dict[str, set]:
    """What the server's tiers hold of `hashes` in the namespaces of `model_id` (its own index)."""
    stats = server_stats(node.shm)
    assert stats is not None
    keys = [bytes(h) for h in hashes]
    view: dict[str, set] = {CPU: set(), STORAGE: set()}
    with Client(node.shm, kind="test", autostart=False) as client:
        for ns, ns_stats in stats.namespaces.items():
            if model_id not in ns_stats.desc or not keys:
                continue
            (bits,) = client.journal([], [(ns, keys)]).held
            for key, held in zip(keys, bits):
                if held & 1:
                    view[CPU].add(key)
                if held & 2:
                    view[STORAGE].add(key)
    return view


def seen(sub: Subscriber) -> set:
    """Every block hash the subscriber ever heard of."""
    return {block_hash for _, block_hash in sub.described}


def agrees(node, sub: Subscriber, model_id: str) -> bool:
    view = server_view(node, model_id, seen(sub))
    return view[CPU] == sub.holds(CPU) and view[STORAGE] == sub.holds(STORAGE)


def test_a_long_prompt_is_announced_for_the_device_dram_and_storage_with_vllms_payload(engines):
    (a, sub, _), _ = engines
    completion = a.complete(prompt_text(1500, seed=351))
    num_blocks = completion.prompt_tokens // BLOCK_SIZE
    wait_for(lambda: len(sub.holds(GPU)) >= num_blocks, timeout_s=30, what="the device's blocks")
    device = sub.holds(GPU)
    wait_for(
        lambda: len(sub.holds(CPU) & device) >= num_blocks and len(sub.holds(STORAGE) & device) >= num_blocks,
        timeout_s=30,
        what="HPKV's DRAM and storage announcements of the prompt's blocks",
    )
    for block_hash in sub.holds(CPU) | sub.holds(STORAGE):  # as vLLM describes the same block
        ours = [sub.described[(m, block_hash)] for m in (CPU, STORAGE) if (m, block_hash) in sub.described]
        assert all(block == sub.described[(GPU, block_hash)] for block in ours)
        assert all(block.block_size == BLOCK_SIZE and len(block.token_ids) == BLOCK_SIZE for block in ours)


def test_a_prefix_cache_reset_clears_the_device_and_leaves_hpkvs_tiers(node, engines):
    from vllm.distributed.kv_events import BlockRemoved

    (a, sub, model_id), _ = engines
    wait_for(lambda: agrees(node, sub, model_id), timeout_s=10, what="a's index to match the server")
    device, dram, storage = sub.holds(GPU), sub.holds(CPU), sub.holds(STORAGE)
    since = time.monotonic()
    a.reset_prefix_cache()
    a.complete(prompt_text(40, seed=350))  # vLLM publishes its device's AllBlocksCleared in its next step
    wait_for(lambda: not sub.holds(GPU) & device, timeout_s=10, what="the device's AllBlocksCleared")
    time.sleep(2 * BOUND_S)
    assert dram <= sub.holds(CPU) and storage <= sub.holds(STORAGE)
    assert not [e for e in sub.events_since(since) if isinstance(e, BlockRemoved) and e.medium != GPU]


def test_an_eviction_from_a_small_pool_is_announced_within_the_bound(node, engines):
    (a, sub, model_id), _ = engines
    first = sub.holds(CPU)
    for seed in range(352, 358):  # past the pool's size: the first prompt's blocks are evicted
        a.complete(prompt_text(1500, seed=seed))
    returned = time.monotonic()  # the last saves (and their evictions) may run in the step after
    wait_for(lambda: agrees(node, sub, model_id), timeout_s=2 * BOUND_S, interval_s=0.05, what="a's index")
    assert first - sub.holds(CPU), "nothing of the first prompt was evicted from the DRAM pool"
    assert time.monotonic() - returned < 2 * BOUND_S
    stats = server_stats(node.shm)
    assert stats is not None and stats.dram.evictions > 0


def test_clears_are_announced_within_the_bound_each_tier_by_its_own(node, engines):
    (a, sub_a, id_a), (b, sub_b, id_b) = engines
    b.complete(prompt_text(1500, seed=359))
    wait_for(lambda: sub_b.holds(CPU) and sub_b.holds(STORAGE), timeout_s=30, what="b's blocks in both tiers")
    env = {**os.environ, **node.env()}  # this tree's hpkv (PYTHONPATH), the node's settings
    for flag, medium, other in (("--memory", CPU, STORAGE), ("--storage", STORAGE, CPU)):
        kept = {id(sub): sub.holds(other) for sub in (sub_a, sub_b)}
        result = hpkv(env, "clear", flag)
        assert result.returncode == 0, result.stderr
        cleared = time.monotonic()
        wait_for(
            lambda m=medium: not sub_a.holds(m) and not sub_b.holds(m),
            timeout_s=BOUND_S,
            interval_s=0.02,
            what=f"the removals of hpkv clear {flag}",
        )
        assert time.monotonic() - cleared < BOUND_S
        assert all(sub.holds(other) == kept[id(sub)] for sub in (sub_a, sub_b))
    for sub, model_id in ((sub_a, id_a), (sub_b, id_b)):
        assert agrees(node, sub, model_id)


def test_each_engine_publishes_only_its_own_namespaces(node, engines):
    (a, sub_a, id_a), (b, sub_b, id_b) = engines
    a.complete(prompt_text(1500, seed=360))
    b.complete(prompt_text(1500, seed=361))
    for sub, model_id in ((sub_a, id_a), (sub_b, id_b)):
        wait_for(lambda s=sub, m=model_id: agrees(node, s, m), timeout_s=10, what=f"{model_id}'s index")
    ours_a = {h for (m, h) in sub_a.described if m in (CPU, STORAGE)}
    ours_b = {h for (m, h) in sub_b.described if m in (CPU, STORAGE)}
    assert ours_a and ours_b
    assert not ours_a & {h for (m, h) in sub_b.described if m == GPU}
    assert not ours_b & {h for (m, h) in sub_a.described if m == GPU}


def test_a_restarted_engine_announces_what_hpkvs_tiers_hold_without_a_request(node, engines):
    (a, sub, model_id), _ = engines  # b keeps the server (and its DRAM pool) up meanwhile
    wait_for(lambda: agrees(node, sub, model_id), timeout_s=10, what="a's index to match the server")
    hashes, server = seen(sub), server_pid(node.shm)
    a.stop()
    a.start()  # no request is sent to it from here on
    assert server_pid(node.shm) == server
    view = server_view(node, model_id, hashes)
    assert view[CPU] and view[STORAGE], "the earlier tests left nothing of a's in HPKV's tiers"
    wait_for(  # from the new engine's events only: the subscriber forgot the old one's at its first batch
        lambda: sub.restarts == 1 and sub.holds(CPU) == view[CPU] and sub.holds(STORAGE) == view[STORAGE],
        timeout_s=10,
        interval_s=0.05,
        what="the restarted engine's announcements of what HPKV holds",
    )
    assert agrees(node, sub, model_id) and not sub.holds(GPU)
