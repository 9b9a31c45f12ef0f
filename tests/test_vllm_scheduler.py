"""The vLLM scheduler half (`HpkvScheduler`) against a real server, as vLLM's engine core calls
it: what it answers for a request when its connection to the server drops, and how it keeps
vLLM's scheduler running whatever goes wrong inside it."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from helpers.scheduler import BS, blocks, prompt, saved, scheduler_half
from helpers.waiting import wait_for

pytestmark = pytest.mark.vllm


@pytest.fixture
def node(node):
    node.start_server()
    return node


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_lease_whose_connection_was_dropped_while_it_promoted_is_a_miss(node, num_ranks):
    """A request's lease was answered while promotions from storage ran; before they finished,
    the scheduler's connection dropped (a timeout) and a later call opened a new one. The lease
    pinned nothing once its connection was gone: the next ask is a miss, neither "ask again"
    (the request would never run) nor an exception (vLLM's engine core would die)."""
    from helpers.keys import entry_key
    from hpkv.integrations.vllm.requests import RequestState as _Req

    scheduler = scheduler_half(node, num_ranks)
    keys = [entry_key("prompt", i) for i in range(4)]
    saved(node, scheduler, keys)
    request = SimpleNamespace(request_id="r", num_tokens=5 * BS + 1, block_hashes=[])
    state = scheduler.table.reqs["r"] = _Req(request, lease_start=0)
    state.leases = {rank: scheduler.client.lease(ns, keys) for rank, ns in enumerate(scheduler._ns)}
    for lease in state.leases.values():
        lease.num_ready = None  # as answered while a promotion ran
    state.leased_at = time.monotonic()

    scheduler.client._drop("a call timed out")
    scheduler.client.stats()  # the next call connects again

    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert state.leases == {}
    # The server takes back what the dropped connection held once it sees it end.
    wait_for(lambda: scheduler.client.stats().leases == 0, what="the dropped connection's leases released")


def test_a_request_that_skips_the_prefix_cache_leases_nothing(node):
    """vLLM drops any hit for a request with prompt logprobs: HPKV answers none and pins none."""
    scheduler = scheduler_half(node, 2)
    request = prompt(node, scheduler, 4, skip_reading_prefix_cache=True)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert scheduler.client.stats().leases == 0


def test_a_hit_vllm_trims_to_nothing_is_unpinned(node):
    """HPKV answers a hit of 4 blocks and leases them; vLLM then loads none of it (it keeps a
    local hit instead): the leases go at once, not when the request ends."""
    scheduler = scheduler_half(node, 2)
    request = prompt(node, scheduler, 4)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (4 * BS, False)
    assert scheduler.client.stats().leases == 2

    scheduler.update_state_after_alloc(request, blocks(7, 8, 9, 10, 11), 0)

    assert scheduler.client.stats().leases == 0 and scheduler._pending_loads == []


def connector_over(scheduler):
    from hpkv.integrations.vllm.connector import HpkvConnectorV1
    from hpkv.integrations.vllm.guard import GuardedScheduler

    connector = HpkvConnectorV1.__new__(HpkvConnectorV1)
    connector._scheduler, connector._worker = GuardedScheduler(scheduler), None
    return connector


def test_a_bug_in_a_lookup_is_a_miss_logged_once_a_minute(node, monkeypatch, caplog):
    """vLLM's block hashes stop making keys (a bug, or a vLLM changed under us): every lookup
    is a miss, the first logged with its traceback, the next ones counted, not logged; the
    engine's scheduler keeps running."""
    from hpkv.integrations.vllm import scheduler as sched

    scheduler = scheduler_half(node, 2)
    connector = connector_over(scheduler)
    request = prompt(node, scheduler, 4)
    monkeypatch.setattr(sched.lay, "block_keys", lambda *args: 1 / 0)

    with caplog.at_level(logging.ERROR, logger="hpkv.vllm"):
        answers = [connector.get_num_new_matched_tokens(request, 0) for _ in range(3)]

    assert answers == [(0, False)] * 3
    assert caplog.text.count("HPKV bug in a lookup") == 1 and "ZeroDivisionError" in caplog.text
    assert connector._scheduler.bugs.num_refused("a lookup") == 2
    assert scheduler.client.stats().leases == 0


def test_a_bug_after_vllm_allocated_a_load_makes_the_workers_fail_it(node, monkeypatch, caplog):
    """HPKV answered a hit of 2 blocks after vLLM's own 2, vLLM allocated for it, and planning
    the load fails: the workers get a load of no entries into those 2 blocks, which they report
    failed, and vLLM recomputes them rather than read whatever the blocks held."""
    from hpkv.integrations.vllm import scheduler as sched
    from hpkv.integrations.vllm.requests import RequestState as _Req

    scheduler = scheduler_half(node, 2)
    connector = connector_over(scheduler)
    request = prompt(node, scheduler, 4)
    scheduler.table.reqs["r"] = _Req(request, lease_start=2)
    monkeypatch.setattr(sched.lay, "block_keys", lambda *args: 1 / 0)

    with caplog.at_level(logging.ERROR, logger="hpkv.vllm"):
        connector.update_state_after_alloc(request, blocks(5, 6, 7, 8, 9), 2 * BS)

    assert [(job.keys, job.block_ids) for job in scheduler._pending_loads] == [([], [7, 8])]
    assert "HPKV bug in a load" in caplog.text


def vllm_cache(num_blocks: int = 32):
    """vLLM's own KV cache manager, prefix caching on, one group of full attention."""
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    return (
        KVCacheManager(config, max_model_len=1024, scheduler_block_size=BS, hash_block_size=BS),
        get_request_block_hasher(BS, sha256),
    )


def test_a_block_that_failed_to_load_is_no_prefix_hit_for_later_prompts(node):
    """Request a: vLLM's prefix cache has nothing, HPKV supplies blocks 0-2 of its 4, vLLM
    allocates (and hashes) all 4, and the step's output reports block 1 failed. vLLM rolls a
    back to recompute from block 1 but keeps it in its prefix cache; a could be preempted
    before it recomputes. Request b, the same prompt, must not find blocks 1 and after in
    vLLM's cache: it hits block 0 only."""
    from vllm import SamplingParams
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from hpkv.integrations.vllm.requests import RequestState as _Req

    cache, hasher = vllm_cache()
    scheduler = scheduler_half(node, 1)
    connector = connector_over(scheduler)
    connector.bind_kv_cache_manager(cache)

    def request(req_id: str):
        return Request(req_id, list(range(4 * BS + 1)), SamplingParams(max_tokens=1), None, block_hasher=hasher)

    a = request("a")
    local, _, _ = cache.get_computed_blocks(a)
    cache.allocate_slots(
        a, BS + 1, num_new_computed_tokens=0, new_computed_blocks=local, num_external_computed_tokens=3 * BS
    )
    (block_ids,) = cache.get_block_ids("a")
    scheduler.table.reqs["a"] = _Req(a, block_ids=block_ids[:4])
    assert cache.get_computed_blocks(request("b"))[1] == 4 * BS  # every block hashed at allocation

    connector.update_connector_output(KVConnectorOutput(invalid_block_ids={block_ids[1]}))

    assert cache.get_computed_blocks(request("b"))[1] == BS


def test_a_sliding_window_model_leases_only_the_window_and_loads_the_whole_hit(node):
    """A model whose one KV cache group is a sliding window (vLLM's hybrid manager on): a hit of 4
    blocks leases and loads only the 2 window blocks before its end (vLLM gives the others the
    null block), and the hit stays 4 blocks long."""
    from hpkv.integrations.vllm.layout import BlockLayout

    scheduler = scheduler_half(node, 1)
    scheduler.layout = scheduler.layouts[0] = BlockLayout(("l0",), (1,), BS, 1, "", window_blocks=2)
    request = prompt(node, scheduler, 4)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (4 * BS, False)
    assert list(scheduler.table.reqs["r"].lease_sizes.values()) == [2]
    scheduler.update_state_after_alloc(request, blocks(0, 0, 12, 13, 14), 4 * BS)
    (job,) = scheduler._pending_loads
    assert (job.keys, job.block_ids) == (request.block_hashes[2:4], [12, 13])
