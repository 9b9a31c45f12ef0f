"""Stories of the tier journal (KV events, issue 35): what entered and left each tier of a watched
namespace, in order, bounded; the store's hooks only while someone watches; the protocol's
`Journal` over a real server, and a peer of the previous protocol refused."""

from __future__ import annotations

import pytest

from helpers.server import raw_connect, read_replies
from hpkv.server import protocol as p
from hpkv.store.journal import STORED, TierJournal
from hpkv.tiers import Tier
from test_store import desc, keys, open_store, save  # noqa: F401  (open_store: a fixture)

D, S = int(Tier.DRAM), int(Tier.STORAGE)


def records(page) -> list[tuple[int, bytes]]:
    return list(zip(page.codes, page.keys))


# -- the journal itself ------------------------------------------------------------------------


def test_a_journal_keeps_the_order_and_only_its_last_records_and_says_when_a_reader_lost_some():
    journal = TierJournal(max_records=4)
    assert journal.watch("ns", owner=1) == 0
    for i in range(6):  # six records, four kept: 3..6
        journal.record("ns", Tier.DRAM, b"k%d" % i, stored=i % 2 == 0)
    caught_up = journal.read("ns", after=2)
    assert not caught_up.lost and caught_up.last == 6 and not caught_up.more
    assert records(caught_up) == [(D | STORED, b"k2"), (D, b"k3"), (D | STORED, b"k4"), (D, b"k5")]
    behind = journal.read("ns", after=1)  # record 2 is gone
    assert behind.lost and behind.last == 6 and len(behind.keys) == 4
    page = journal.read("ns", after=2, max_records=3)
    assert page.last == 5 and page.more and journal.read("ns", after=page.last).keys == [b"k5"]
    assert journal.read("ns", after=6).keys == [] and journal.read("ns", after=6).last == 6


def test_a_namespace_nobody_watches_is_not_journaled_and_goes_with_its_last_watcher():
    journal = TierJournal()
    journal.record("ns", Tier.DRAM, b"k", stored=True)
    assert journal.read("ns", after=0) is None and not journal.watched
    journal.watch("ns", owner=1)
    journal.watch("ns", owner=2)
    journal.record("ns", Tier.STORAGE, b"k", stored=True)
    journal.unwatch_owner(1)
    assert records(journal.read("ns", after=0)) == [(S | STORED, b"k")]
    journal.unwatch_owner(2)
    assert journal.read("ns", after=0) is None and not journal.watched


# -- the store's hooks -------------------------------------------------------------------------


def test_a_watched_namespace_journals_commits_write_throughs_evictions_and_clears_per_tier(open_store):
    store = open_store(pool_bytes=4 << 20)  # 64 entries of 64 KiB: the 70th save evicts
    ns, quiet = store.register(desc()), store.register(desc("other"))
    assert store.dram.changes is None  # nobody watches: no hook runs
    last = store.watches.watch(ns, owner=7)
    ks = keys(70)
    for at in range(0, 70, 10):
        save(store, ns, ks[at : at + 10])
        assert store.flush(timeout=10)
    save(store, quiet, keys(3, "quiet"))
    page = store.watches.read(ns, last, 1 << 16)
    dram_in = [k for c, k in records(page) if c == D | STORED]
    dram_out = [k for c, k in records(page) if c == D]
    # in commit order, batch by batch (within one commit, the store's own order)
    assert [set(dram_in[at : at + 10]) for at in range(0, 70, 10)] == [set(ks[at : at + 10]) for at in range(0, 70, 10)]
    assert dram_out and set(dram_out) < set(ks[:60])  # evicted: the oldest
    assert sorted(k for c, k in records(page) if c == S | STORED) == sorted(ks)
    assert all(k not in keys(3, "quiet") for k in page.keys)
    store.clear(dram=True, storage=True)
    cleared = store.watches.read(ns, page.last, 1 << 16)
    held_before = set(ks) - set(dram_out)
    assert {k for c, k in records(cleared) if c == D} == held_before
    assert {k for c, k in records(cleared) if c == S} == set(ks)
    assert store.watches.held(ns, ks[:2]) == b"\0\0"
    store.drop_owner(7)  # its last watcher gone: the hooks with it
    assert store.dram.changes is None and store.storage.index.numbers.changes is None


def test_held_says_per_key_which_tiers_hold_it(open_store):
    store = open_store()
    ns = store.register(desc())
    ks = keys(3)
    save(store, ns, ks[:2])
    assert store.flush(timeout=10)
    store.clear(dram=True, ns=ns)
    save(store, ns, ks[1:2])
    assert store.watches.held(ns, ks) == bytes([S, D | S, 0])


# -- the protocol --------------------------------------------------------------------------------


def test_journal_over_the_socket_watches_reads_on_and_marks_a_cursor_into_an_unkept_journal_lost(node):
    node.start_server()
    worker, reader = node.client("vllm-worker-0"), node.client("vllm-events")
    ns = worker.register(desc())
    reader.register(desc())
    (watched,) = reader.journal([(ns, -1)]).pages
    assert watched.last == 0 and not watched.lost
    ks = keys(3)
    worker.commit(worker.reserve(ns, ks))
    reply = reader.journal([(ns, watched.last)], held=[(ns, ks[:1] + keys(1, "never"))])
    (page,) = reply.pages
    assert sorted(records(page)) == sorted((D | STORED, k) for k in ks) and reply.held == [bytes([D, 0])]
    reader.close()  # its only watcher gone: the journal of ns is not kept
    again = node.client("vllm-events")
    again.register(desc())
    (lost,) = again.journal([(ns, page.last)]).pages
    assert lost.lost and lost.keys == []


def test_a_peer_of_the_previous_protocol_is_refused_naming_both_versions(node):
    node.start_server()
    with raw_connect(node, hello=False) as sock:
        sock.sendall(p.encode(p.Hello(p.PROTOCOL_VERSION - 1, "vllm-scheduler", 1)))
        (reply,) = read_replies(sock)
    assert isinstance(reply, p.Error) and reply.code == "version"
    assert f"protocol {p.PROTOCOL_VERSION - 1}" in reply.message and f"speaks {p.PROTOCOL_VERSION}" in reply.message
    assert p.PROTOCOL_VERSION == 7  # 7 added Journal.describe, .snapshot: a server of 6 would refuse them as malformed


@pytest.mark.parametrize("max_records", [1, 2])
def test_records_past_the_bound_make_every_slower_reader_lost(max_records):
    journal = TierJournal(max_records=max_records)
    journal.watch("ns", 1)
    for i in range(3):
        journal.record("ns", Tier.DRAM, b"%d" % i, True)
    assert journal.read("ns", 0).lost and not journal.read("ns", 3 - max_records).lost
