"""Which saves the vLLM scheduler holds, and how it settles them (`pending.PendingSaves`): steps are
numbered, a step with loads holds its saves and those of every step built before its output is
back, and a request vLLM finds reading a failed block loses the saves held on top of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture
def holds():
    from hpkv.integrations.vllm.pending import PendingSaves

    return PendingSaves()


def test_steps_hold_their_saves_from_a_load_until_its_output_is_back(holds):
    from hpkv.integrations.vllm.pending import Settle

    assert holds.begin_step(1, has_loads=False) == ""
    assert holds.begin_step(2, has_loads=True) == holds.name(2)
    assert holds.begin_step(3, has_loads=False) == holds.name(3)  # built before step 2's output
    holds.add(2, "r", [b"k2"], [10, 11], first_block=1)
    holds.add(3, "q", [b"k3"], [20], first_block=0)

    assert holds.step_done({2}) == [Settle(holds.name(2), [], {})]
    assert holds.begin_step(4, has_loads=False) == ""  # step 2's output is back: nothing to wait for
    assert holds.step_done({3}) == [Settle(holds.name(3), [], {})]
    assert holds.pending() == 0


def test_a_request_that_read_a_failed_block_loses_the_saves_held_on_top_of_it(holds):
    holds.begin_step(5, has_loads=True)
    holds.add(5, "bad", [b"a", b"b"], [1, 2, 3], first_block=1)
    holds.add(5, "good", [b"c"], [7, 8], first_block=1)
    holds.begin_step(6, has_loads=False)  # async scheduling: built before step 5's output
    holds.add(6, "bad", [b"d"], [1, 2, 3, 4], first_block=3)
    holds.add(6, "good", [b"e"], [7, 8, 9], first_block=2)

    assert holds.affected({2}) == {"bad"}
    holds.poison({"bad"}, up_to_seq=6)
    (five,) = holds.step_done({5})
    assert (five.abort, five.resave) == ([b"a", b"b"], {})  # its KV rests on the failed block
    holds.begin_step(7, has_loads=False)  # built after the rollback: "bad" is recomputed from here
    (six,) = holds.step_done({6})
    assert (six.abort, six.resave) == ([b"d"], {})
    holds.begin_step(8, has_loads=True)
    holds.add(8, "bad", [b"a"], [1, 5], first_block=1)
    assert holds.step_done({8})[0].abort == []  # its recomputed blocks are saved


def test_a_step_a_rank_did_not_copy_in_full_is_aborted_whole(holds):
    holds.begin_step(3, has_loads=True)
    holds.add(3, "r", [b"x", b"y"], [1, 2], first_block=0)
    holds.add(3, "s", [b"z"], [5], first_block=0)

    (three,) = holds.step_done({3}, failed={3})
    assert (three.abort, three.resave) == ([b"x", b"y", b"z"], {"r": 0, "s": 0})


def test_a_step_whose_output_never_came_is_settled_with_the_next_one(holds):
    holds.begin_step(1, has_loads=True)
    holds.add(1, "r", [b"x"], [1], first_block=0)
    holds.begin_step(2, has_loads=True)
    holds.add(2, "r", [b"y"], [1, 2], first_block=1)

    assert [s.hold for s in holds.step_done({2})] == [holds.name(1), holds.name(2)]
    assert holds.begin_step(3, has_loads=False) == ""


def test_a_stopping_engine_aborts_every_hold_it_has_not_settled(holds):
    holds.begin_step(1, has_loads=True)
    holds.add(1, "r", [b"x"], [1], first_block=0)

    assert [(s.hold, s.abort) for s in holds.abandon()] == [(holds.name(1), [b"x"])]
    assert holds.pending() == 0


def test_worker_metadata_of_every_rank_aggregates_to_the_steps_they_ran():
    from hpkv.integrations.vllm.pending import HpkvWorkerMeta

    meta = HpkvWorkerMeta({4}).aggregate(HpkvWorkerMeta({4}, {4})).aggregate(HpkvWorkerMeta({5}))
    assert (meta.seqs, meta.failed) == ({4, 5}, {4})


def test_the_scheduler_settles_a_step_on_every_rank_and_rewinds_the_requests_that_read_a_failed_block(
    shm_dir, tmp_path
):
    """The scheduler half against a real server, with two ranks' workers as plain clients: a
    step's output names a failed block of one request; that request's held saves are aborted in
    both namespaces and it saves again from the failed block, the other request's are published,
    and the lease the step loaded under is released."""
    from vllm.v1.outputs import KVConnectorOutput

    from helpers.keys import desc, entry_key, payload
    from helpers.server import Node
    from hpkv.costmodel import FixedThreshold
    from hpkv.integrations.vllm.connectorstats import HpkvConnectorStats
    from hpkv.integrations.vllm.pending import HpkvWorkerMeta
    from hpkv.integrations.vllm.requests import NEVER
    from hpkv.integrations.vllm.requests import RequestState as _Req
    from hpkv.integrations.vllm.scheduler import HpkvScheduler
    from hpkv.integrations.vllm.table import RequestTable

    node = Node(shm_dir, tmp_path)
    node.start_server()
    try:
        ranks = [node.client(f"vllm-worker-{r}") for r in (0, 1)]
        namespaces = [client.register(desc(r)) for r, client in enumerate(ranks)]
        scheduler = HpkvScheduler.__new__(HpkvScheduler)  # the half as vLLM's engine core holds it
        scheduler.client = node.client("vllm-scheduler")
        for r in (0, 1):
            scheduler.client.register(desc(r))
        scheduler.stats, scheduler.table, scheduler.block_size = HpkvConnectorStats(), RequestTable(), 32
        scheduler.table.seq = 1
        scheduler.policy = FixedThreshold(1204, 32)
        scheduler.kv_cache_manager = None  # un-hashing failed blocks: tests/test_vllm_scheduler.py
        # vLLM's requests as update_from_output leaves them: "bad" rolled back to its failed block
        # 11, "shares" (block 11 through vLLM's prefix cache) left relying on bad's recompute.
        scheduler.table.reqs["bad"] = _Req(
            SimpleNamespace(num_computed_tokens=32), block_ids=[10, 11, 12, 13], saved_blocks=4
        )
        scheduler.table.reqs["good"] = _Req(SimpleNamespace(num_computed_tokens=64), block_ids=[20, 21], saved_blocks=2)
        scheduler.table.reqs["shares"] = _Req(
            SimpleNamespace(num_computed_tokens=96), block_ids=[10, 11, 30], saved_blocks=3
        )
        loaded = entry_key("loaded", 0)
        for r, client in enumerate(ranks):  # an entry a request loaded, under the scheduler's lease
            client.commit(client.reserve(namespaces[r], [loaded]))
        scheduler.table.reqs["good"].leases = {0: scheduler.client.lease(namespaces[0], [loaded])}
        scheduler.table.loading(1, [("good", [20]), ("bad", [10, 11])])
        bad_keys = [entry_key("bad", 2), entry_key("bad", 3), entry_key("shares", 2)]
        good_keys = [entry_key("good", 1)]
        hold = scheduler.table.pending.begin_step(1, has_loads=True)
        scheduler.table.pending.add(1, "bad", bad_keys[:2], [10, 11, 12, 13], first_block=2)
        scheduler.table.pending.add(1, "shares", bad_keys[2:], [10, 11, 30], first_block=2)
        scheduler.table.pending.add(1, "good", good_keys, [20, 21], first_block=1)
        for r, client in enumerate(ranks):
            reservation = client.reserve(namespaces[r], bad_keys + good_keys, hold=hold)
            for key, offset in zip(bad_keys + good_keys, reservation.offsets):
                size = reservation.entry_bytes
                client.region.buf[offset : offset + size] = payload(key, r, size)

        scheduler.update_connector_output(
            KVConnectorOutput(invalid_block_ids={11}, kv_connector_worker_meta=HpkvWorkerMeta({1}))
        )

        for r, client in enumerate(ranks):
            assert client.lookup(namespaces[r], good_keys).num_hit == 1
            assert client.lookup(namespaces[r], bad_keys).num_hit == 0
            assert client.stats().reservations == 0 and client.stats().holds == 0
        assert scheduler.table.reqs["bad"].saved_blocks == 1  # from block 11, which vLLM recomputes
        assert scheduler.table.reqs["good"].saved_blocks == 2
        assert scheduler.table.reqs["shares"].saved_blocks == NEVER  # its KV rests on bad's recompute
        assert scheduler.stats.data["held_saves_aborted"] == 3
        assert scheduler.table.reqs["good"].leases == {} and scheduler.client.stats().leases == 0
    finally:
        node.close()
