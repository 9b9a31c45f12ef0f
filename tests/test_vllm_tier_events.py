"""Stories of `TierEvents` (integrations/vllm/events.py) on a real server and real vLLM requests,
no engine: what a save, a lease, the journal and a lost journal make of vLLM's KV events."""

from __future__ import annotations

import pytest

from helpers.keys import desc

pytestmark = pytest.mark.vllm

BS = 32


def vllm_request(seed: int, num_blocks: int, cache_salt: str | None = None):
    """A vLLM `Request` of `num_blocks` full blocks and one token more, hashed as vLLM hashes it."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    tokens = [(seed * 7919 + i) % 5000 for i in range(num_blocks * BS + 1)]
    hasher = get_request_block_hasher(BS, sha256)
    return Request(f"r{seed}", tokens, SamplingParams(max_tokens=1), None, cache_salt=cache_salt, block_hasher=hasher)


@pytest.fixture
def events_node(node):
    """(server node, a worker's client and namespace, TierEvents attached and watching from now)."""
    from hpkv.integrations.vllm.events import TierEvents
    from hpkv.integrations.vllm.layout import BlockLayout

    node.start_server()
    worker = node.client("vllm-worker-0")
    ns = worker.register(desc(0, entry_bytes=4096))
    scheduler = node.client("vllm-scheduler")
    scheduler.register(desc(0, entry_bytes=4096))
    events = TierEvents([BlockLayout(("l0",), (4096,), BS, 1, "")], num_ranks=1)
    events.attach([ns])
    events.resync(scheduler)  # watch from now: nothing described yet
    return worker, scheduler, ns, events


def drain(client, events) -> list:
    """Apply the journal past the events' cursors, then take the events."""
    for page in client.journal(list(events.cursors.items())).pages:
        events.apply(page.ns, page.codes, page.keys, page.last)
    return events.take()


def keys_of(request, num_blocks: int) -> list[bytes]:
    return [bytes(h) for h in request.block_hashes[:num_blocks]]


def test_a_saved_block_is_announced_in_the_dram_tier_with_the_payload_vllm_gives_it(events_node):
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    worker, scheduler, ns, events = events_node
    request = vllm_request(1, 3, cache_salt="salt")
    events.saving(request, 0, 3)
    assert drain(scheduler, events) == []  # described, not held yet
    worker.commit(worker.reserve(ns, keys_of(request, 3)))
    (stored,) = drain(scheduler, events)  # one event for the chain, as vLLM's device cache sends it
    assert isinstance(stored, BlockStored) and stored.medium == "CPU" and stored.group_idx == 0
    assert stored.block_hashes == [maybe_convert_block_hash(h) for h in request.block_hashes[:3]]
    assert stored.parent_block_hash is None and stored.block_size == BS
    assert stored.token_ids == request.all_token_ids[: 3 * BS]
    assert stored.extra_keys == [("salt",), None, None]  # vLLM's event form: the salt on the first block


def test_removals_follow_the_stores_they_undo_and_only_for_what_was_announced(events_node):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from hpkv.tiers import Tier

    worker, scheduler, ns, events = events_node
    request, other = vllm_request(2, 2), vllm_request(3, 2)
    events.saving(request, 0, 2)
    worker.commit(worker.reserve(ns, keys_of(request, 2) + keys_of(other, 2)))  # other: never described here
    scheduler.clear(dram=True, ns=ns)  # stored and removed before the engine reads the journal
    got = drain(scheduler, events)
    assert [type(e) for e in got] == [BlockStored, BlockRemoved]
    assert got[1].medium == "CPU" and set(got[1].block_hashes) == set(got[0].block_hashes)
    assert events.held_blocks(Tier.DRAM) == set()


def test_a_lease_answer_announces_what_the_tiers_hold_and_a_lost_journal_is_learnt_again(events_node):
    from vllm.distributed.kv_events import BlockRemoved

    from hpkv.tiers import Tier

    worker, scheduler, ns, events = events_node
    request = vllm_request(4, 4)
    worker.commit(worker.reserve(ns, keys_of(request, 4)))  # before this engine ever saw the request
    lease = scheduler.lease(ns, keys_of(request, 4))
    events.leased(request, 0, [lease], [ns])
    (stored,) = events.take()
    assert stored.medium == "CPU" and len(stored.block_hashes) == 4
    scheduler.release(lease)
    scheduler.clear(dram=True, ns=ns)
    for cursor in events.cursors:  # as if the server's bound had dropped the records since
        events.cursors[cursor] = 10**9
    assert drain(scheduler, events) == []  # nothing read: the records are "lost"
    events.resync(scheduler)
    (removed,) = events.take()
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU" and len(removed.block_hashes) == 4
    assert events.held_blocks(Tier.DRAM) == set()


def test_two_requests_branching_from_one_block_have_every_block_announced_in_a_chain_each(events_node):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash
    from vllm.v1.request import Request

    worker, scheduler, ns, events = events_node
    vllm_request(0, 1)  # vLLM's hash seed set
    shared = list(range(BS))
    left, right = (
        Request(name, shared + [tail] * (num_blocks * BS + 1), SamplingParams(max_tokens=1), None,
                block_hasher=get_request_block_hasher(BS, sha256))
        for name, tail, num_blocks in (("left", 1, 2), ("right", 2, 1))
    )  # fmt: skip
    events.saving(left, 0, 3)
    events.saving(right, 0, 2)
    worker.commit(worker.reserve(ns, keys_of(left, 3) + keys_of(right, 2)[1:]))
    got = drain(scheduler, events)
    convert = lambda hashes: [maybe_convert_block_hash(h) for h in hashes]  # noqa: E731
    # the shared block (two children: a chain of its own), then each branch as one chain
    assert sorted(e.block_hashes for e in got) == sorted(
        [convert(left.block_hashes[:1]), convert(left.block_hashes[1:3]), convert(right.block_hashes[1:2])]
    )


def test_a_restarted_server_has_the_feed_remove_the_dram_blocks_it_announced(node):
    """EventFeed as the scheduler holds it (its poller thread, its resync), across a server that
    is killed and started again: its DRAM pool is gone, its storage is not."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from helpers.server import kill_server, server_pid
    from helpers.waiting import wait_for
    from hpkv.integrations.vllm.eventfeed import EventFeed
    from hpkv.integrations.vllm.layout import BlockLayout

    node.start_server()
    worker, scheduler = node.client("vllm-worker-0"), node.client("vllm-scheduler")
    ns = worker.register(desc(0, entry_bytes=4096))
    scheduler.register(desc(0, entry_bytes=4096))
    feed = EventFeed([BlockLayout(("l0",), (4096,), BS, 1, "")], num_ranks=1, client=scheduler)
    feed.attach([ns], [desc(0, entry_bytes=4096)])
    try:
        request = vllm_request(5, 3)
        feed.saving(request, 0, 3)
        worker.commit(worker.reserve(ns, keys_of(request, 3)))
        stored: list = []
        wait_for(lambda: stored.extend(feed.take_events()) or {e.medium for e in stored} == {"CPU", "STORAGE"},
                 timeout_s=10, interval_s=0.05, what="the blocks announced in both tiers")  # fmt: skip
        assert all(isinstance(e, BlockStored) and len(e.block_hashes) == 3 for e in stored)
        kill_server(server_pid(node.shm_dir))
        node.start_server()
        got: list = []
        wait_for(lambda: got.extend(feed.take_events()) or got, timeout_s=20, interval_s=0.1, what="the resync")
        assert [(type(e), e.medium, len(e.block_hashes)) for e in got] == [(BlockRemoved, "CPU", 3)]
    finally:
        feed.close()


def blocks(events) -> set[tuple]:
    """Each block of some BlockStored events as (medium, hash, parent, tokens, extra keys), however
    they were batched."""
    out = set()
    for e in events:
        parent = e.parent_block_hash
        for i, block_hash in enumerate(e.block_hashes):
            extra = e.extra_keys[i] if e.extra_keys else None
            out.add((e.medium, block_hash, parent, tuple(e.token_ids[i * BS : (i + 1) * BS]), extra, e.group_idx))
            parent = block_hash
    return out


def test_a_feed_started_after_another_announces_what_the_tiers_hold_of_its_descriptions(node):
    """An engine restarted on the same server: a second EventFeed, attached at its first check
    (no request), announces the blocks the first one described and the tiers still hold, with the
    same payload; a description of a block no tier holds, or one that does not decode, is not."""
    import msgspec
    from vllm.distributed.kv_events import BlockStored

    from helpers.waiting import wait_for
    from hpkv.integrations.vllm.eventfeed import EventFeed
    from hpkv.integrations.vllm.layout import BlockLayout
    from hpkv.server import protocol as p

    node.start_server()
    worker = node.client("vllm-worker-0")
    ns = worker.register(desc(0, entry_bytes=4096))
    layouts = [BlockLayout(("l0",), (4096,), BS, 1, "")]

    def started_feed() -> EventFeed:
        scheduler = node.client("vllm-scheduler")
        scheduler.register(desc(0, entry_bytes=4096))
        feed = EventFeed(layouts, 1, scheduler, start=lambda: feed.attach([ns], [desc(0, entry_bytes=4096)]))
        assert not feed.pending() and feed.poller is not None  # attached at its first check
        return feed

    def announced(feed: EventFeed, media: set[str]) -> list:
        got: list = []
        wait_for(lambda: got.extend(feed.take_events()) or {e.medium for e in got} >= media,
                 timeout_s=10, interval_s=0.05, what=f"announcements in {media}")  # fmt: skip
        return got

    first = started_feed()
    request, unsaved, broken = vllm_request(6, 3, cache_salt="salt"), vllm_request(7, 1), vllm_request(8, 1)
    first.saving(request, 0, 3)
    first.saving(unsaved, 0, 1)  # described, never committed
    worker.commit(worker.reserve(ns, keys_of(request, 3) + keys_of(broken, 1)))
    before = announced(first, {"CPU", "STORAGE"})
    first.close()
    first.client.close()  # the engine is gone; the server and its tiers stay
    worker.journal([], describe=[p.Described(ns, keys_of(broken, 1), [msgspec.msgpack.encode(["junk"])])])
    second = started_feed()
    try:
        after = announced(second, {"CPU", "STORAGE"})
        assert all(isinstance(e, BlockStored) for e in before + after)
        assert blocks(after) == blocks(before) and len(blocks(after)) == 6  # 3 blocks, 2 tiers
        assert second.take_events() == []
    finally:
        second.close()
