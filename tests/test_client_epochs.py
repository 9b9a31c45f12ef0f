"""Stories of handles that outlive their connection: a reservation or a lease belongs to the
connection that made it, and once that connection is gone, nothing the client does with the
handle may reach the slots a newer connection holds."""

from __future__ import annotations

import threading

import pytest

from helpers.keys import desc, entry_key, payload
from helpers.server import Node
from helpers.waiting import wait_for
from hpkv.config import load_settings
from hpkv.server import daemon
from hpkv.server.autostart import answers
from hpkv.tiers import Tier

ENTRY = 64 << 10


@pytest.fixture
def node(shm_dir, tmp_path, monkeypatch):
    """A node whose server runs in this process, so the test can shorten its quarantine."""
    monkeypatch.setattr(daemon, "QUARANTINE_S", 0.2)
    node = Node(shm_dir, tmp_path)
    server = daemon.Server(load_settings(node.env))
    thread = threading.Thread(target=server.run, name="hpkv-server", daemon=True)
    thread.start()
    wait_for(lambda: answers(node.socket_path), what="the server answers")
    yield node
    node.close()
    server.stop()
    thread.join(timeout=30)


def test_a_reservation_of_a_closed_connection_neither_commits_nor_aborts_what_a_newer_one_reserved(node):
    """A copying thread holds a reservation; another thread's call times out and the connection
    closes; the client reconnects and, once the server's quarantine is over, the same key is
    reserved again in a new slot. The first thread's commit and abort must not touch that slot."""
    writer = node.client("writer", retry_interval_s=0.0)
    ns = writer.register(desc(0, ENTRY))
    key = entry_key("prompt", 0)
    old = writer.reserve(ns, [key])
    assert old.offsets != [None]
    writer._drop("a call timed out")  # what the client does after another thread's timeout

    new = wait_for(
        lambda: (lambda r: r if r.offsets != [None] else None)(writer.reserve(ns, [key])),
        what="the key reserved again after the quarantine",
    )
    assert not writer.alive(old) and writer.alive(new)
    assert writer.commit(old) == 0
    writer.abort(old)
    assert writer.lookup(ns, [key]).num_hit == 0  # nothing published before its copy
    assert writer.stats().reservations == 1  # and the new slot is still the copier's

    new.view(0)[:] = payload(key, 0, ENTRY)
    assert writer.commit(new) == 1
    lease = writer.lease(ns, [key])
    assert writer.wait(lease) == 1 and bytes(lease.view(0)) == payload(key, 0, ENTRY)
    writer.release(lease)


def test_commit_and_abort_never_connect(node):
    """With no connection there is no reservation to end: the calls send nothing and the
    client stays disconnected (a new connection would own nothing of the old one's)."""
    writer = node.client("writer", retry_interval_s=0.0)
    ns = writer.register(desc(0, ENTRY))
    key = entry_key("prompt", 0)
    res = writer.reserve(ns, [key])
    writer._drop("a call timed out")

    assert writer.commit(res) == 0
    writer.abort(res)
    assert not writer.connected


def test_a_lease_is_void_as_soon_as_its_connection_goes(node):
    """A reader waits for a lease whose entry is being promoted from storage; the connection
    drops meanwhile. The lease is void at once, before any reconnect, and waiting on it asks no
    newer connection about a lease id that is not its own."""
    client = node.client("reader", retry_interval_s=0.0)
    ns = client.register(desc(0, ENTRY))
    key = entry_key("prompt", 0)
    res = client.reserve(ns, [key])
    res.view(0)[:] = payload(key, 0, ENTRY)
    assert client.commit(res) == 1
    wait_for(lambda: client.stats().storage.num_entries == 1, what="the write-through")
    client.clear(dram=True)
    assert client.lookup(ns, [key]).tiers == (Tier.STORAGE,)

    lease = client.lease(ns, [key])
    assert lease.num_ready is None  # the read from storage starts after the reply
    client._drop("a call timed out")

    assert not client.alive(lease)
    assert client.wait(lease) == 0
    client.release(lease)
    assert not client.connected
