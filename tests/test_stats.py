"""Stories about the stats schema (`hpkv.stats`): a real server's snapshot fits it and loses no field
on the way, and a snapshot with a field missing, mistyped or unknown fails naming that field.

`stats_from(parts)` builds a whole `ServerStats` from the parts a test cares about (the rest zero),
for tests of what reads a snapshot (doctor, status)."""

from __future__ import annotations

import copy

import msgspec
import pytest
from serverutil import Node, desc, entry_key, raw_connect

from hpkv import stats
from hpkv.server import protocol as p

ZERO_STATS: dict = {
    "store": {name: 0 for name in stats.StoreCounters.__struct_fields__},
    "dram": {"capacity_bytes": 64 << 20, "used_bytes": 0, "num_entries": 0, "free_slabs": 0, "evictions": 0,
             "slab_moves": 0, "reserve_failures": 0, "locked_in_memory": True},
    "namespaces": {},
    "leases": 0,
    "reservations": 0,
    "limits": {"slot_timeout_s": None, "max_slot_bytes": None, "max_held_bytes": 0, "capped_keys": 0,
               "expired_reservations": 0, "expired_leases": 0},
    "quarantined": 0,
    "holds": 0,
    "write_backlog": None,
    "storage": None,
    "storage_unusable": None,
    "writers": None,
    "server": {"pid": 1, "version": "0", "protocol": p.PROTOCOL_VERSION, "auto": False, "uptime_s": 0.0,
               "socket": "/dev/shm/hpkv/hpkv.sock", "pool_path": "/dev/shm/hpkv/hpkv.pool",
               "storage_path": "/tmp/storage"},
    "clients": [],
}
ZERO_STORAGE: dict = {name: 0 for name in stats.StorageStats.__struct_fields__} | {
    "index_ready": True, "direct_io": False, "write_budget_bytes": None, "write_budget_available_bytes": None}


def stats_from(parts: dict) -> stats.ServerStats:
    """A snapshot of `parts` (top-level fields, each merged into a zero one), the rest zero."""
    raw = copy.deepcopy(ZERO_STATS)
    for name, value in parts.items():
        if name == "storage" and value is not None:
            value = {**ZERO_STORAGE, **value}
        elif isinstance(value, dict) and isinstance(raw.get(name), dict) and name != "namespaces":
            value = {**raw[name], **value}
        raw[name] = value
    return stats.from_parts(raw)


@pytest.fixture
def node(shm_dir, tmp_path):
    node = Node(shm_dir, tmp_path)
    yield node
    node.close()


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
