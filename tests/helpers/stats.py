"""Stats snapshots for tests of what reads one (doctor, status): `stats_from(parts)` builds a whole
`ServerStats` from the parts a test cares about, the rest zero."""

from __future__ import annotations

import copy

from hpkv import stats
from hpkv.server import protocol as p

ZERO_STATS: dict = {
    "store": {name: 0 for name in stats.StoreCounters.__struct_fields__},
    "dram": {
        "capacity_bytes": 64 << 20,
        "used_bytes": 0,
        "num_entries": 0,
        "free_slabs": 0,
        "evictions": 0,
        "slab_moves": 0,
        "reserve_failures": 0,
        "locked_in_memory": True,
        "ready_bytes": 64 << 20,
        "locked_bytes": 64 << 20,
    },
    "namespaces": {},
    "namespace_summary": {
        "total": 0,
        "held": 0,
        "refused": 0,
        "max_desc_bytes": None,
        "max_per_uid": None,
        "max_total": None,
        "next_after": None,
    },
    "leases": 0,
    "reservations": 0,
    "limits": {
        "slot_timeout_s": None,
        "max_slot_bytes": None,
        "max_held_bytes": 0,
        "capped_keys": 0,
        "expired_reservations": 0,
        "expired_leases": 0,
    },
    "quarantined": 0,
    "holds": 0,
    "write_backlog": None,
    "storage": None,
    "storage_unusable": None,
    "writers": None,
    "cluster": None,
    "cluster_unusable": None,
    "server": {
        "pid": 1,
        "version": "0",
        "protocol": p.PROTOCOL_VERSION,
        "auto": False,
        "uptime_s": 0.0,
        "socket": "/dev/shm/hpkv/hpkv.sock",
        "pool_path": "/dev/shm/hpkv/hpkv.pool",
        "storage_path": "/tmp/storage",
    },
    "clients": [],
}
ZERO_STORAGE: dict = {name: 0 for name in stats.StorageStats.__struct_fields__} | {
    "index_ready": True,
    "direct_io": False,
    "write_budget_bytes": None,
    "write_budget_available_bytes": None,
    "root_replaced": None,
    "cluster": None,
}


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
