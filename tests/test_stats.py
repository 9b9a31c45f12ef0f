"""Stories about the stats schema (`hpkv.stats`): a real server's snapshot fits it and loses no field
on the way, and a snapshot with a field missing, mistyped or unknown fails naming that field."""

from __future__ import annotations

import copy

import msgspec
import pytest

from helpers.keys import desc, entry_key
from helpers.server import raw_connect
from helpers.stats import ZERO_STATS, stats_from
from hpkv import stats
from hpkv.server import protocol as p


def test_a_real_servers_stats_fit_the_schema_and_lose_no_field(node):
    node.start_server()
    client = node.client("engine")
    ns = client.register(desc())
    client.lookup(ns, [entry_key("a", 0)])
    typed = client.stats()
    assert isinstance(typed, stats.ServerStats) and isinstance(typed.storage, stats.StorageStats)
    assert typed.namespaces[ns].lookups == 1 and typed.store.lookups == 1
    assert [c.kind for c in typed.clients] == ["engine"]
    sock = raw_connect(node)  # what the wire carries, untyped
    sock.sendall(p.encode(p.Stats()))
    raw = p.decode_reply(p.recv_frame(sock)).stats
    sock.close()
    again = stats.from_parts(raw)  # strict: a field the schema lacks would fail here
    assert set(msgspec.to_builtins(again)) == set(raw)
    assert again.server.pid == typed.server.pid and again.namespaces == typed.namespaces


def test_a_missing_field_fails_naming_it():
    raw = copy.deepcopy(ZERO_STATS)
    del raw["dram"]["free_slabs"]
    with pytest.raises(stats.StatsMismatch, match=r"missing required field `free_slabs` - at `\$.dram`"):
        stats.from_wire(raw)


def test_a_mistyped_field_fails_naming_it():
    raw = copy.deepcopy(ZERO_STATS)
    raw["server"]["pid"] = "1234"
    with pytest.raises(stats.StatsMismatch, match=r"Expected `int`, got `str` - at `\$.server.pid`"):
        stats.from_wire(raw)


def test_a_field_the_schema_lacks_fails_on_the_server_side_only():
    raw = copy.deepcopy(ZERO_STATS)
    raw["clients"] = [{"id": 1, "pid": 2, "uid": 0, "kind": "cli", "connected_s": 0.5, "leases": 0, "new": 1}]
    with pytest.raises(stats.StatsMismatch, match=r"lacks: \$.clients\[0\].new"):
        stats.from_parts(raw)
    assert stats.from_wire(raw).clients[0].kind == "cli"  # a client reads a newer server's snapshot


def test_stats_from_fills_what_a_test_leaves_out():
    snapshot = stats_from({"storage": {"used_bytes": 5}, "server": {"pid": 42}})
    assert snapshot.storage is not None and snapshot.storage.used_bytes == 5 and snapshot.storage.reads == 0
    assert snapshot.server.pid == 42 and snapshot.write_backlog is None
