"""The calls each engine process makes to the HPKV server for one request (issue 33): vLLM's
scheduler half and each rank's worker half, the real `HpkvScheduler` and `HpkvWorker` on a real
server and real CPU tensors, driven as vLLM's engine core and model runner call them, every
request frame counted where the client sends it (`Channel._roundtrip`).

One request hits H blocks (in DRAM, or on storage only) and computes S more, which it saves. A
model of one KV cache group at TP 1 and 2, and a hybrid model (linear-attention state groups
beside a full-attention one). The counts are the same whatever the ranks, the groups and the
blocks; what they are is asserted too, so a new round trip shows here."""

from __future__ import annotations

import importlib.util
import threading
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from helpers.keys import desc, entry_key, payload
from helpers.waiting import wait_for

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")

BS, PAGE, NUM_BLOCKS, COMPUTED = 32, 4096, 64, 2


def counted(client) -> Counter:
    """Every request `client` sends from now on, by message type."""
    calls: Counter = Counter()
    roundtrip = client._roundtrip

    def counting(msg, timeout_s):
        calls[type(msg).__name__] += 1
        return roundtrip(msg, timeout_s)

    client._roundtrip = counting
    return calls


def layouts_of(num_state_groups: int):
    from hpkv.integrations.vllm.layout import BlockLayout

    groups = num_state_groups + 1
    states = [BlockLayout((f"s{g}",), (PAGE,), BS, 1, "s", g, groups, 1, True) for g in range(num_state_groups)]
    return [*states, BlockLayout(("a",), (PAGE,), BS, 1, "a", num_state_groups, groups)]


def scheduler_half(node, layouts, num_ranks: int):
    """The half as vLLM's engine core holds it, loading every hit (threshold 0)."""
    from hpkv.costmodel import FixedThreshold
    from hpkv.identity import IdentityTask, override_identity
    from hpkv.integrations.vllm.connectorstats import HpkvConnectorStats
    from hpkv.integrations.vllm.scheduler import HpkvScheduler
    from hpkv.integrations.vllm.table import RequestTable

    s = HpkvScheduler.__new__(HpkvScheduler)
    s.client = node.client("vllm-scheduler", retry_interval_s=0.0)
    s.descs = [desc(r, PAGE, model=f"g{g}") for r in range(num_ranks) for g in range(len(layouts))]
    s._ns = [s.client.register(d) for d in s.descs]
    s.identity = IdentityTask.of(override_identity("test"))
    s.stats, s.policy = HpkvConnectorStats(), FixedThreshold(0, BS)
    s.table, s._pending_loads, s._step_loads = RequestTable(), [], []
    s.layouts, s.layout, s.block_size, s.num_ranks = layouts, layouts[0], BS, num_ranks
    s.async_loads, s.kv_cache_manager = len(layouts) > 1, None
    return s


def worker_half(node, layouts, rank: int):
    """A rank's half as register_kv_caches leaves it: real client, real copiers, synchronous saves."""
    from hpkv.integrations.vllm.connectorstats import HpkvConnectorStats
    from hpkv.integrations.vllm.savequeue import SaveQueue
    from hpkv.integrations.vllm.worker import HpkvWorker
    from hpkv.transfer.blocks import BlockCopier

    w = HpkvWorker.__new__(HpkvWorker)
    w.rank, w.async_saves, w.layouts = rank, False, layouts
    w.client = node.client(f"vllm-worker-{rank}", retry_interval_s=0.0)
    w.stats, w._failed_blocks, w._failed_holds, w._meta_out = HpkvConnectorStats(), set(), set(), None
    w._stats_lock, w._side_stream, w._releaser, w._recving = threading.Lock(), None, None, (set(), set())
    w.saves = SaveQueue(w._save)
    w.caches = [torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.int8) for _ in layouts]  # one layer per group
    w.copiers = [BlockCopier([cache], (0,)) for cache in w.caches]
    w.descs = [desc(rank, PAGE, model=f"g{g}") for g in range(len(layouts))]
    w.nss = [w.client.register(d) for d in w.descs]
    return w


def saved(node, layouts, num_ranks: int, keys: list[bytes], storage: bool) -> None:
    """What earlier requests saved on every rank: the attention blocks of `keys` and each state
    group's state at their end; with `storage`, on storage only (out of DRAM)."""
    client = node.client("earlier")
    for rank in range(num_ranks):
        for g, layout in enumerate(layouts):
            ns = client.register(desc(rank, PAGE, model=f"g{g}"))
            chosen = keys[-1:] if layout.state else keys
            res = client.reserve(ns, chosen)
            for i, key in enumerate(chosen):
                res.view(i)[:] = payload(key, rank, PAGE)
            assert client.commit(res) == len(chosen)
    if storage:
        wait_for(lambda: client.stats().write_backlog.entries == 0, what="the write-throughs")
        client.clear(dram=True)
    client.close()


def scheduler_output(req_id: str, group_blocks, computed: int, scheduled: int, offers=None):
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    new = SimpleNamespace(req_id=req_id, block_ids=group_blocks, num_computed_tokens=computed)
    return SimpleNamespace(
        scheduled_new_reqs=[new] if scheduled else [],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req_id: scheduled} if scheduled else {},
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offers or {}),
    )


def step(sched, workers, out) -> None:
    """One step: the metadata built, each rank's hooks around the forward pass, the output read."""
    from vllm.v1.outputs import KVConnectorOutput

    meta = sched.build_connector_meta(out)
    metas = []
    for w in workers:
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        metas.append(w.worker_meta(meta.seq))
        if w._releaser is not None:  # the release of its leases, on its own thread
            w._releaser.submit(lambda: None).result()
    for other in metas[1:]:
        metas[0].aggregate(other)
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids=set(), kv_connector_worker_meta=metas[0]))


def one_request(node, num_state_groups: int, num_ranks: int, num_hit: int, storage: bool) -> list[Counter]:
    """The calls of the scheduler half, then of each rank's worker, for one request."""
    layouts = layouts_of(num_state_groups) if num_state_groups else layouts_of(0)[-1:]
    keys = [
        entry_key(f"prompt-{num_state_groups}-{num_ranks}-{num_hit}-{storage}", i) for i in range(num_hit + COMPUTED)
    ]
    saved(node, layouts, num_ranks, keys[:num_hit], storage)
    sched = scheduler_half(node, layouts, num_ranks)
    workers = [worker_half(node, layouts, rank) for rank in range(num_ranks)]
    calls = [counted(sched.client), *(counted(w.client) for w in workers)]

    request = SimpleNamespace(request_id="r", num_tokens=len(keys) * BS + 1, block_hashes=keys)
    matched, load_async = sched.get_num_new_matched_tokens(request, 0)
    assert (matched, load_async) == (num_hit * BS, len(layouts) > 1)
    attention = list(range(1, len(keys) + 2))
    states = [[0] * (num_hit - 1) + [40 + g] + [0] * (COMPUTED + 1) for g in range(num_state_groups)]
    group_blocks = (*states, attention)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: group_blocks), matched)
    computed, scheduled = num_hit * BS, COMPUTED * BS + 1
    offers = {"r": [(g, 50 + g, len(keys) * BS) for g in range(num_state_groups)]}
    if load_async:  # vLLM loads first (the request waits), then computes in a later step
        step(sched, workers, scheduler_output("r", group_blocks, computed, 0))
    step(sched, workers, scheduler_output("r", group_blocks, computed, scheduled, offers))
    sched.request_finished(request)

    for rank, w in enumerate(workers):  # the loads and saves did happen
        assert w.stats.data.get("loaded_blocks", 0) == num_hit + num_state_groups, w.stats.data
        assert w.caches[-1][1].numpy().tobytes() == payload(keys[0], rank, PAGE)  # block 0 of the hit
    observer = node.client("observer")
    assert observer.lookup(observer.register(desc(0, PAGE, model=f"g{len(layouts) - 1}")), keys).num_hit == len(keys)
    stats = observer.stats()
    assert stats.leases == 0 and stats.reservations == 0 and stats.holds == 0
    for w in workers:
        w.shutdown()
    sched.client.close()
    return calls


@pytest.fixture
def server(node):
    node.start_server()
    return node


@pytest.mark.parametrize("storage", [False, True], ids=["dram", "storage"])
def test_a_one_group_model_asks_the_same_few_calls_whatever_its_ranks_and_blocks(server, storage, monkeypatch):
    from hpkv.integrations.vllm import scheduler

    monkeypatch.setattr(scheduler, "READY_WAIT_S", 30.0)  # promotions are waited for in one call
    runs = {(ranks, hit): one_request(server, 0, ranks, hit, storage) for ranks in (1, 2) for hit in (2, 6)}
    for (ranks, hit), calls in runs.items():
        print(f"one group, TP {ranks}, {hit} blocks, {'storage' if storage else 'DRAM'}: {[dict(c) for c in calls]}")
    sched, *workers = runs[(1, 2)]
    expected_sched = {"Lease": 1, "Release": 1, "Settle": 1} | ({"LeaseWait": 1} if storage else {})
    assert dict(sched) == expected_sched
    assert [dict(w) for w in workers] == [{"Lease": 1, "Reserve": 1, "Release": 1}]
    for calls in runs.values():
        assert dict(calls[0]) == expected_sched and all(dict(w) == dict(workers[0]) for w in calls[1:])


@pytest.mark.parametrize("storage", [False, True], ids=["dram", "storage"])
def test_a_hybrid_model_asks_the_same_few_calls_whatever_its_ranks_groups_and_blocks(server, storage, monkeypatch):
    from hpkv.integrations.vllm import scheduler

    monkeypatch.setattr(scheduler, "READY_WAIT_S", 30.0)
    runs = {
        (groups, ranks, hit): one_request(server, groups, ranks, hit, storage)
        for groups, ranks, hit in [(1, 1, 2), (1, 2, 2), (2, 1, 2), (1, 1, 6), (2, 2, 6)]
    }
    for key, calls in runs.items():
        print(f"hybrid, state groups/TP/blocks {key}, {'storage' if storage else 'DRAM'}: {[dict(c) for c in calls]}")
    expected_sched = {"Lookup": 1, "Lease": 1, "Release": 1} | ({"LeaseWait": 1} if storage else {})
    expected_worker = {"Lease": 1, "Release": 1, "Reserve": 1, "Commit": 1}
    for calls in runs.values():
        assert dict(calls[0]) == expected_sched
        assert all(dict(w) == expected_worker for w in calls[1:])


@pytest.mark.parametrize("num_state_groups, asked", [(0, "Lease"), (1, "Lookup")], ids=["one-group", "hybrid"])
def test_a_miss_costs_the_scheduler_one_call_and_pins_nothing(server, num_state_groups, asked):
    layouts = layouts_of(num_state_groups) if num_state_groups else layouts_of(0)[-1:]
    sched = scheduler_half(server, layouts, 2)
    calls = counted(sched.client)
    keys = [entry_key(f"never-saved-{num_state_groups}", i) for i in range(4)]
    request = SimpleNamespace(request_id="r", num_tokens=len(keys) * BS + 1, block_hashes=keys)

    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert dict(calls) == {asked: 1}
    assert sched.client.stats().leases == 0
    sched.client.close()
