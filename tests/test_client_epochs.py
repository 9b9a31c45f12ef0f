"""Stories of handles that outlive their connection: a reservation or a lease belongs to the
connection that made it, and once that connection is gone, nothing the client does with the
handle may reach the slots a newer connection holds."""

from __future__ import annotations

import threading

import pytest

from serverutil import Node, _answers, desc, entry_key, payload, wait_for
from hpkv.config import load_settings
from hpkv.server import daemon
from hpkv.store import Tier

ENTRY = 64 << 10


@pytest.fixture
def node(shm_dir, tmp_path, monkeypatch):
    """A node whose server runs in this process, so the test can shorten its quarantine."""
    monkeypatch.setattr(daemon, "QUARANTINE_S", 0.2)
    node = Node(shm_dir, tmp_path)
    server = daemon.Server(load_settings(node.env))
    thread = threading.Thread(target=server.run, name="hpkv-server", daemon=True)
    thread.start()
    wait_for(lambda: _answers(node.socket_path), what="the server answers")
    yield node
    node.close()
    server.stop()
    thread.join(timeout=30)


def test_a_lease_is_void_as_soon_as_its_connection_goes(node):
    """A reader waits for a lease whose entry is being promoted from storage; the connection
    drops meanwhile. The lease is void at once, before any reconnect, and waiting on it asks no
    newer connection about a lease id that is not its own."""
    client = node.client("reader", retry_interval_s=0.0)
    ns = client.register(desc(0, ENTRY))
    key = entry_key("prompt", 0)
    res = client.reserve(ns, [key])
    res.view(0)[:] = payload(key, 0, ENTRY)
    assert client.commit(ns, [key]) == 1
    wait_for(lambda: client.stats()["storage"]["num_entries"] == 1, what="the write-through")
    client.clear(memory=True)
    assert client.lookup(ns, [key]).tiers == (Tier.STORAGE,)

    lease = client.lease(ns, [key])
    assert lease.num_ready is None  # the read from storage starts after the reply
    client._drop("a call timed out")

    assert not client.holds(lease)
    assert client.wait(lease) == 0
    client.release(lease)
    assert not client.connected
