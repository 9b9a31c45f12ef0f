"""Stories of the block descriptions the server keeps for the engines that start later (KV events
after an engine restart, issue 35): bounded by count and bytes, oldest first; dropped once a
journal read sees their key leave every tier; paged in the order given; answered only for keys
a tier holds; kept after the engine that gave them is gone; bounded per message over the socket."""

from __future__ import annotations

import pytest

from hpkv.server import protocol as p
from hpkv.server.client import ServerError
from hpkv.store import descriptions as d
from hpkv.store.descriptions import Descriptions
from hpkv.tiers import Tier
from test_store import desc, keys, open_store, save  # noqa: F401  (open_store: a fixture)

D, S = int(Tier.DRAM), int(Tier.STORAGE)


def blob(i: int, size: int = 100) -> bytes:
    return bytes([i % 256]) * size


# -- the descriptions themselves ---------------------------------------------------------------


def test_past_the_count_the_oldest_description_goes_whatever_its_namespace():
    kept = Descriptions(max_count=4)
    ks = keys(5)
    kept.put("a", ks[:2], [blob(0), blob(1)])
    kept.put("b", ks[2:4], [blob(2), blob(3)])
    kept.put("a", ks[:1], [blob(9)])  # given again: the newest now
    kept.put("b", ks[4:], [blob(4)])  # the fifth: the oldest (ks[1] in a) goes
    assert kept.has("a", ks) == [ks[0]] and kept.has("b", ks) == ks[2:]
    assert kept.stats()[0] == 4 and kept.num_dropped == 1
    assert kept.page("a", 0, 10, 1 << 20).blobs == [blob(9)]


def test_past_the_bytes_the_oldest_go_and_a_blob_over_its_bound_is_not_kept():
    entry = 32 + 1000 + d.ENTRY_BYTES
    kept = Descriptions(max_bytes=3 * entry)
    ks = keys(5)
    kept.put("a", ks[:4], [blob(i, 1000) for i in range(4)])
    assert kept.has("a", ks) == ks[1:4] and kept.stats() == (3, 3 * entry)
    assert kept.put("a", ks[4:], [blob(4, d.MAX_BLOB_BYTES + 1)]) == 0
    assert kept.has("a", ks[4:]) == [] and d.MAX_BLOB_BYTES == p.MAX_BLOB_BYTES
    kept.drop("a", ks)
    assert kept.stats() == (0, 0)


def test_pages_read_on_in_the_order_given_each_description_at_most_once():
    kept = Descriptions()
    ks = keys(10)
    kept.put("a", ks[:6], [blob(i) for i in range(6)])
    first = kept.page("a", 0, 4, 1 << 20)
    assert first.keys == ks[:4] and first.more
    kept.drop("a", ks[4:5])  # gone before it was read: not answered
    kept.put("a", ks[:1] + ks[6:], [blob(20)] + [blob(i) for i in range(6, 10)])  # ks[0] again: read again, last
    rest = kept.page("a", first.last, 100, 1 << 20)
    assert rest.keys == ks[5:6] + ks[:1] + ks[6:] and not rest.more
    assert kept.page("a", rest.last, 100, 1 << 20).keys == []
    assert kept.page("a", 0, 100, 250).keys == [ks[1]]  # bytes: 100 + 32 each, ks[0] now last
    assert kept.page("other", 0, 100, 1 << 20) == d.DescribedPage([], [], 0, False)


# -- in the store: held, dropped on leave, watched or not ----------------------------------------


def test_a_snapshot_answers_only_keys_a_tier_holds_and_a_journal_read_drops_those_gone(open_store):
    store = open_store()
    ns = store.register(desc())
    last = store.watches.watch(ns, owner=7)
    ks = keys(4)
    store.watches.describe(ns, ks, [blob(i) for i in range(4)])  # before their commit, as an engine does
    save(store, ns, ks[:3])  # ks[3]: never saved (a save skipped): kept, not answered
    assert store.flush(timeout=10)
    page, held = store.watches.snapshot(ns, 0, [ns], 100, 1 << 20)
    assert page.keys == ks[:3] and page.blobs == [blob(i) for i in range(3)] and held == [bytes([D | S] * 3)]
    store.clear(dram=True, ns=ns)  # still on storage: kept
    last = store.watches.read(ns, last, 1 << 16).last
    assert store.watches.descriptions.has(ns, ks) == ks
    store.clear(storage=True, dram=False, ns=ns)  # in no tier now
    assert store.watches.snapshot(ns, 0, [ns], 100, 1 << 20)[0].keys == []  # never stale, read or not
    store.watches.read(ns, last, 1 << 16)
    assert store.watches.descriptions.has(ns, ks) == ks[3:]


def test_descriptions_stay_when_nobody_watches_and_are_paged_with_the_tiers_of_every_rank(open_store):
    store = open_store()
    ns0, ns1 = store.register(desc(rank=0)), store.register(desc(rank=1))
    ks = keys(3)
    store.watches.describe(ns0, ks, [blob(i) for i in range(3)])  # nobody watches: kept all the same
    save(store, ns0, ks)
    save(store, ns1, ks[1:])
    store.drop_owner(7)
    page, held = store.watches.snapshot(ns0, 0, [ns0, ns1], 2, 1 << 20)
    assert page.keys == ks[:2] and page.more and held[1][0] == 0 and held[1][1] & D
    page, held = store.watches.snapshot(ns0, page.last, [ns0, ns1], 2, 1 << 20)
    assert page.keys == ks[2:] and not page.more and held[0][0] & D and held[1][0] & D


# -- over the socket -----------------------------------------------------------------------------


def test_journal_keeps_descriptions_past_their_engine_and_pages_them_bounded(node):
    node.start_server()
    worker, engine = node.client("vllm-worker-0"), node.client("vllm-events")
    ns = worker.register(desc())
    engine.register(desc())
    ks = keys(3)
    described = p.Described(ns, ks + keys(1, "big"), [blob(i) for i in range(3)] + [blob(3, p.MAX_BLOB_BYTES + 1)])
    engine.journal([(ns, -1)], describe=[described])
    worker.commit(worker.reserve(ns, ks + keys(1, "big")))
    engine.close()  # the engine that described them is gone (and nobody watches ns)
    again = node.client("vllm-events")
    again.register(desc())
    reply = again.journal([], snapshot=[p.Snapshot(ns, 0, [ns])])
    (page,) = reply.snapshot
    assert page.keys == ks and page.blobs == [blob(i) for i in range(3)] and page.held == [bytes([D] * 3)]
    assert not page.more and again.journal([], snapshot=[p.Snapshot(ns, page.last, [ns])]).snapshot[0].keys == []
    too_many = p.Described(ns, keys(p.MAX_DESCRIBED + 1), [b""] * (p.MAX_DESCRIBED + 1))
    with pytest.raises(ServerError, match="more than"):
        again.journal([], describe=[too_many])
    with pytest.raises(ServerError, match="held_in"):
        again.journal([], snapshot=[p.Snapshot(ns, 0, [ns] * (p.MAX_SNAPSHOT_NAMESPACES + 1))])
    with pytest.raises(ServerError, match="one blob per key"):
        again.journal([], describe=[p.Described(ns, ks, [])])
