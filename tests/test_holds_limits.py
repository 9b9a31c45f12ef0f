"""Stories about the limits on what one client holds: a client that reserves or leases much of
the pool and keeps it leaves the other engines their share, and gives its slots back after the
time limit, through a quarantine, never into the hands of another writer while it may still copy."""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import pytest

from helpers.clock import FakeClock
from helpers.config import make_pool_config, make_storage_config
from helpers.keys import desc, entry_key, entry_keys, payload
from helpers.server import Node
from helpers.waiting import wait_for
from hpkv.config import load_settings
from hpkv.keys import NamespaceDesc
from hpkv.server import daemon
from hpkv.server.autostart import answers
from hpkv.store import HOLD_QUARANTINE_S, TieredStore, create_store

ENTRY = 64 << 10
POOL = 16 << 20  # 256 entries, in 32 slabs of 8
TIMEOUT_S = 300.0


def stopped_clock() -> FakeClock:
    # Where the store's own clock is (what was held before keeps its age), in whole seconds:
    # steps that add up to the time limit then reach it exactly.
    return FakeClock(float(math.ceil(time.monotonic())))


@pytest.fixture
def store(shm_dir, storage_dir):
    # DRAM only: no write-through pins what is committed
    store = create_store(
        make_pool_config(shm_dir, POOL), dataclasses.replace(make_storage_config(storage_dir), enabled=False)
    )
    store.limits.clock = stopped_clock()
    yield store
    store.close()


def register(store: TieredStore) -> str:
    return store.register(
        NamespaceDesc(
            engine="test",
            model="tiny",
            dtype="float16",
            layout="blocks",
            block_size=32,
            num_layers=2,
            entry_bytes=ENTRY,
        )
    )


def test_a_client_that_reserves_the_whole_pool_gets_its_share_and_the_next_one_the_rest(store):
    store.limits.configure(TIMEOUT_S, POOL // 2)
    ns = register(store)

    hog = store.reserve(ns, entry_keys(256, "hog"), owner=1)
    other = store.reserve(ns, entry_keys(64, "other"), owner=2)

    assert sum(o is not None for o in hog) == 128 and hog[128:] == [None] * 128
    assert None not in other
    assert store.stats().limits.capped_keys == 128
    assert store.commit(ns, entry_keys(256, "hog"), owner=1) == 128  # then it may take as much again
    assert sum(o is not None for o in store.reserve(ns, entry_keys(128, "hog2"), owner=1)) == 128


def test_a_lease_stops_at_the_clients_share_and_the_rest_is_a_miss(store):
    ns = register(store)
    ks = entry_keys(48, "doc")
    store.reserve(ns, ks)
    store.commit(ns, ks)
    store.limits.configure(TIMEOUT_S, 32 * ENTRY)

    first = store.lease(ns, ks[:24], owner=1)
    second = store.lease(ns, ks, owner=1)

    assert len(first.entries) == 24 and len(second.entries) == 8
    assert store.stats().limits.capped_keys == 40
    store.release(first.id)
    assert len(store.lease(ns, ks, owner=1).entries) == 24  # what the first gave back


def test_a_reservation_kept_past_the_limit_is_quarantined_then_reused(store):
    """A wedged copier reserved the whole pool. Past the limit its slots are taken back, but
    nobody else gets them while it may still be copying; after the quarantine they are free."""
    store.limits.configure(TIMEOUT_S, None)
    ns = register(store)
    stuck = entry_keys(256, "stuck")
    slots = set(store.reserve(ns, stuck, owner=1))
    assert None not in slots

    store.limits.clock.now += TIMEOUT_S - 1
    assert store.reserve(ns, entry_keys(1, "early"), owner=2) == [None]  # not yet: the pool is its own
    store.limits.clock.now += 1
    during = store.reserve(ns, entry_keys(256, "during"), owner=2)

    assert during == [None] * 256  # taken back, but quarantined: the copy may still go on
    stats = store.stats()
    assert stats.limits.expired_reservations == 256 and stats.quarantined == 256
    assert stats.reservations == 0
    assert store.commit(ns, stuck, owner=1) == 0  # too late: nothing of it is published
    assert store.lookup(ns, stuck).num_hit == 0

    store.limits.clock.now += HOLD_QUARANTINE_S
    after = store.reserve(ns, entry_keys(256, "after"), owner=2)
    assert set(after) == slots and store.stats().quarantined == 0


def test_a_lease_kept_past_the_limit_pins_its_entries_through_the_quarantine_then_lets_go(store):
    store.limits.configure(TIMEOUT_S, None)
    ns = register(store)
    ks = entry_keys(256, "doc")
    store.reserve(ns, ks)
    store.commit(ns, ks)
    lease = store.lease(ns, ks, owner=1)
    assert len(lease.entries) == 256

    store.limits.clock.now += TIMEOUT_S
    assert store.reserve(ns, entry_keys(8, "new"), owner=2) == [None] * 8  # its reader may still copy
    assert store.stats().limits.expired_leases == 1 and store.stats().leases == 0
    assert not store.release(lease.id)  # taken back already

    store.limits.clock.now += HOLD_QUARANTINE_S
    assert None not in store.reserve(ns, entry_keys(8, "new"), owner=2)  # evicted now, like any entry
    assert store.lookup(ns, ks).num_hit == 256 - 8  # the last first: the lease unpinned them so
    assert store.limits.room(1) == float("inf") and store.limits.bytes_taken() == {2: 8 * ENTRY}


def test_without_limits_a_store_in_process_holds_as_before(store):
    ns = register(store)
    assert None not in store.reserve(ns, entry_keys(256, "all"), owner=1)
    store.limits.clock.now += 10 * TIMEOUT_S
    assert store.reserve(ns, entry_keys(1, "more"), owner=2) == [None]
    assert store.stats().limits.expired_reservations == 0


# -- a real server, two clients -----------------------------------------------------------------


@pytest.fixture
def node(shm_dir, tmp_path):
    """A node whose server runs in this process (real socket, real pool), on a clock the test moves."""
    node = Node(shm_dir, tmp_path, HPKV_SERVER_MAX_SLOT_SHARE="0.5", HPKV_SERVER_SLOT_TIMEOUT_S="300")
    server = daemon.Server(load_settings(node.env))
    thread = threading.Thread(target=server.run, name="hpkv-server", daemon=True)
    thread.start()
    wait_for(lambda: answers(node.socket_path), what="the server answers")
    node.server = server
    yield node
    node.close()
    server.stop()
    thread.join(timeout=30)


def test_a_client_that_keeps_what_it_reserved_and_leased_leaves_the_other_engine_room(node):
    """The pool holds 256 entries. A hog (another process) reserves them all and leases what
    another engine saved, and keeps both. The other engine still saves, and once the hog's hold
    is past the limit (and the quarantine) it has the pool back. The hog's late commit publishes
    nothing."""
    hog, engine = node.agent("hog"), node.client("engine")
    hog.call("register")
    ns = engine.register(desc(0))

    saved = [entry_key("saved", i) for i in range(64)]
    res = engine.reserve(ns, saved)
    for i, key in enumerate(saved):
        res.view(i)[:] = payload(key)
    assert engine.commit(res) == 64
    region = res.region
    lease = hog.call("load", prefix="saved", n=64, release=False)
    assert lease["num_ready"] == 64
    held = hog.call("reserve", prefix="grab", n=256)
    assert held["reserved"] == 64  # 128 in all: half the pool

    mine = [entry_key("mine", i) for i in range(64)]
    res = engine.reserve(ns, mine)
    assert None not in res.offsets  # room left for the other engine
    engine.abort(res)

    clock = node.server.store.limits.clock = stopped_clock()
    clock.now += 300
    more = [entry_key("more", i) for i in range(128)]
    res = engine.reserve(ns, more)  # takes the hog's holds back; their slots wait out the quarantine
    assert set(res.offsets).isdisjoint(held["offsets"]) and set(res.offsets).isdisjoint(lease["offsets"])
    stats = engine.stats()
    assert stats.limits.expired_reservations == 64 and stats.limits.expired_leases == 1
    assert [c.leases for c in stats.clients if c.kind == "hog"] == [0]
    assert hog.call("commit")["committed"] == 0
    assert engine.lookup(ns, [entry_key("grab", i) for i in range(256)]).num_hit == 0
    # still its bytes: nobody may write there yet
    assert bytes(region.view(lease["offsets"][0], res.entry_bytes)) == payload(saved[0])
    engine.abort(res)

    clock.now += HOLD_QUARANTINE_S
    res = engine.reserve(ns, [entry_key("after", i) for i in range(128)])
    assert None not in res.offsets
    assert "taken back" in _status(node)


def _status(node) -> str:
    import io

    from rich.console import Console

    from hpkv.status import print_status

    console = Console(file=io.StringIO(), width=250)
    print_status(node.client("status").stats(), console)
    return console.file.getvalue()


def test_a_handle_past_the_servers_time_limit_is_not_held_on_the_clients_side_either(shm_dir, tmp_path):
    """A reader that copies out of a lease after the server took it back (and, after the
    quarantine, gave its slots to someone else) must see `holds()` False and discard the bytes;
    a saver likewise must not publish. The client learns the limit in the Welcome."""
    node = Node(shm_dir, tmp_path, HPKV_SERVER_SLOT_TIMEOUT_S="1")
    server = daemon.Server(load_settings(node.env))
    thread = threading.Thread(target=server.run, name="hpkv-server", daemon=True)
    thread.start()
    try:
        wait_for(lambda: answers(node.socket_path), what="the server answers")
        client = node.client("worker")
        ns = client.register(desc(0))
        saved = [entry_key("saved", i) for i in range(4)]
        res = client.reserve(ns, saved)
        assert client.slot_timeout_s == 1.0 and client.alive(res)
        for i, key in enumerate(saved):
            res.view(i)[:] = payload(key)
        client.commit(res)
        lease = client.lease(ns, saved)
        late = client.reserve(ns, [entry_key("late", 0)])
        assert client.alive(lease) and client.alive(late)
        time.sleep(1.05)
        assert not client.alive(lease) and not client.alive(late)
        assert client.connected  # the connection lives on: only the expired handles are void
    finally:
        node.close()
        server.stop()
        thread.join(timeout=30)


def test_a_connection_holds_a_bounded_number_of_keys_reserved_and_a_hold_is_never_committed_by_its_owner(node):
    """The server names a connection's reservations until they end (commit and abort name them
    by id): past MAX_OPEN_KEYS keys a Reserve is refused with an error naming the limit, and a
    reservation made in a hold cannot be committed by the client that made it, only settled."""
    from hpkv.server.channel import ServerError
    from hpkv.server.handlers import MAX_OPEN_KEYS

    node.start_server()
    client = node.client("engine")
    ns = client.register(desc(0, ENTRY))
    with pytest.raises(ServerError, match=f"over the limit of {MAX_OPEN_KEYS}") as refused:
        client.reserve(ns, [i.to_bytes(8, "little") for i in range(MAX_OPEN_KEYS + 1)])
    assert refused.value.code == "limit" and client.stats().reservations == 0

    held = client.reserve(ns, entry_keys(2, "held"), hold="step-1")
    with pytest.raises(ServerError, match="settled by Settle"):
        client.commit(held)
    assert client.lookup(ns, entry_keys(2, "held")).num_hit == 0
    assert client.settle("step-1", []).num_committed == 2
    assert client.lookup(ns, entry_keys(2, "held")).num_hit == 2
