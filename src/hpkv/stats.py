"""The schema of a server's stats snapshot: what `Server.stats()` builds and `Client.stats()` returns.

Owns: one msgspec Struct per component (`StoreCounters`, `DramStats`, `StorageStats`,
`StorageClusterStats`, `WriteBacklogStats`, `WriterStats`, `ClusterStats`, `LimitStats`,
`NamespaceSummary`, `NamespaceStats`, `ClientStats`, `ServerInfo`), each returned by its
component's `stats()`, and the counters components count into (`StoreCounters` itself,
`NamespaceHits`, `StorageCounters`); `StoreStats` (the store's) and the whole `ServerStats` (the
store's and the server's); `from_wire` (the client's conversion) and `from_parts` (the strict one:
a field the schema lacks fails too). Field names are the wire's: the snapshot crosses the socket
as a plain map, so a struct is renamed only with the protocol version.

Engine processes read stats through `Client.stats()`, so this module imports nothing server-side.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from .errors import HpkvError


class StatsMismatch(HpkvError):
    """A snapshot and this schema disagree: a field missing, mistyped, or not in the schema."""


S = TypeVar("S", bound=msgspec.Struct)


def zeroed(cls: type[S]) -> S:
    """A struct of counters, every one 0: what a component counts into from its start."""
    return cls(**dict.fromkeys(cls.__struct_fields__, 0))


class StoreCounters(msgspec.Struct):
    """The store's own counters since the server started (the store counts into one: `zeroed`)."""

    lookups: int
    lookup_keys: int
    hit_keys_dram: int
    hit_keys_storage: int
    commits: int
    aborts: int
    skipped_present: int
    leases: int
    promotions: int
    promotion_failures: int
    write_through_skipped: int
    write_through_deferred: int
    write_through_lost: int


@dataclass
class NamespaceHits:
    """One namespace's hit counters (`StoreStats.namespaces[ns]`, beside its description), which
    the lookups bump under the store's lock."""

    lookups: int = 0
    lookup_keys: int = 0
    hit_keys_dram: int = 0
    hit_keys_storage: int = 0

    def count(self, num_keys: int, num_dram: int, num_storage: int) -> None:
        """One lookup of `num_keys` keys, whose leading hits were in DRAM and on storage."""
        self.lookups += 1
        self.lookup_keys += num_keys
        self.hit_keys_dram += num_dram
        self.hit_keys_storage += num_storage


@dataclass
class StorageCounters:
    """The storage tier's counters (`StorageStats` carries each)."""

    reads: int = 0
    read_bytes: int = 0
    read_misses: int = 0
    writes: int = 0
    write_bytes: int = 0
    write_failures: int = 0
    bad_files: int = 0
    evictions: int = 0
    space_errors: int = 0
    files_scanned: int = 0
    temps_removed: int = 0
    over_budget: int = 0
    untrusted_files: int = 0  # links, FIFOs... in the tree: skipped, never hits (`storage/tree.py`)
    stale_entries: int = 0  # indexed files found gone (another server or node removed them): forgotten


class DramStats(msgspec.Struct):
    """The DRAM tier's."""

    capacity_bytes: int
    used_bytes: int
    num_entries: int
    free_slabs: int
    evictions: int
    slab_moves: int
    reserve_failures: int
    locked_in_memory: bool  # every page locked, or where nothing can swap
    ready_bytes: int = 0  # from the pool's start, pages reserved: what slots are handed out from
    locked_bytes: int = 0  # pages that cannot be swapped out (locked, or nothing can swap)
    no_lock_why: str | None = None  # why no lock is needed (no swap configured, ramfs); None: it is


class ClusterStats(msgspec.Struct):
    """The cluster tier's (`hpkv.cluster.tier`): counters since the server started."""

    master: str = ""
    protocol: str = ""
    segment_bytes: int = 0  # HPKV_CLUSTER_SEGMENT_SIZE: what this node contributes
    reachable: bool = False  # the last call reached the master (and the breaker is closed)
    lookups: int = 0
    lookup_keys: int = 0
    found_keys: int = 0  # keys a lookup found in the cluster
    hits: int = 0  # objects read into the pool and verified
    misses: int = 0  # objects asked for and not read (gone, or the read failed)
    bad_objects: int = 0  # read but not what they claim (namespace, key, length, checksum): removed
    objects_written: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_dropped: int = 0  # committed entries not written: the write queue was full
    errors: int = 0  # calls or objects that failed for the cluster's sake (misses are not errors)
    timeouts: int = 0  # lookups that waited the whole HPKV_CLUSTER_TIMEOUT_S
    breaker_open: bool = False  # the tier is skipped for now after failures
    breaker_trips: int = 0
    segment_pid: int | None = None  # the process contributing this node's segment, while it runs


class StorageClusterStats(msgspec.Struct):
    """A storage root shared by a cluster of nodes (HPKV_KV_STORAGE_CLUSTER, `storage/cluster.py`):
    this node's view of it. Ages are seconds before the snapshot (None: never)."""

    member: str  # this server's lease name in <path>/cluster/members (host and incarnation)
    lease_s: float  # HPKV_KV_STORAGE_LEASE
    live_members: list[str]  # the members live in this node's view, sorted (this one among them)
    parts: int  # parts of the key space in all (65,536)
    parts_owned: int  # this node's, by rendezvous hashing over `live_members`
    parts_evictable: int  # owned for the hold already (the others evict in a part gained only after it)
    fenced: bool  # this node evicts nothing: its last renewal or listing of the members is too old
    capacity_share_bytes: int  # the root's capacity x parts_owned / parts: what this node holds its parts to
    owned_bytes: int  # indexed in its parts (what counts against capacity_share_bytes)
    owned_files: int
    foreign_files: int  # indexed in others' parts: what it wrote or read lately (at most 65,536)
    renewals: int  # of its lease (a rename every third of the lease)
    renew_failures: int
    lease_remade: int  # its lease found gone (reaped while it stalled) and made again
    listings: int  # of the members
    list_failures: int
    members_expired: int  # members this node saw go silent past the lease (their parts taken over)
    members_back: int  # expired members seen renewing again (a stall that ended)
    leases_reaped: int  # expired members' leases this node removed (as the owner of part 0)
    last_renew_age_s: float | None
    passes: int  # over its parts (`storage/owner_pass.py`)
    pass_failures: int
    last_pass_age_s: float | None  # since the last pass ended
    last_pass_s: float | None  # how long it took
    last_pass_dirs_statted: int  # leaf directories of its parts looked at (one `stat` each)
    last_pass_dirs_listed: int  # of which listed (changed since they were last listed)
    last_pass_files_statted: int  # names found there that it did not index (one `lstat` each)
    last_pass_added: int  # files it indexed
    last_pass_gone: int = 0  # indexed files it found removed by others, and forgot


class StorageStats(msgspec.Struct):
    """The storage tier's."""

    capacity_bytes: int
    used_bytes: int
    num_entries: int
    index_ready: bool
    direct_io: bool
    write_budget_bytes: int | None  # per day; None: unlimited
    write_budget_available_bytes: int | None  # None: unlimited
    reads: int
    read_bytes: int
    read_misses: int
    writes: int
    write_bytes: int
    write_failures: int
    bad_files: int
    evictions: int
    space_errors: int
    files_scanned: int
    temps_removed: int
    over_budget: int
    untrusted_files: int
    retention_s: float | None = None  # HPKV_KV_STORAGE_RETENTION; None: off
    expired: int = 0  # files removed for being unused longer than the retention
    stale_entries: int = 0  # indexed files found gone (another server or node removed them): forgotten
    root_replaced: str | None = None  # the storage directory was moved away under the server: what, and the fix
    cluster: StorageClusterStats | None = None  # None: the root is not shared as a cluster (HPKV_KV_STORAGE_CLUSTER)


class WriteBacklogStats(msgspec.Struct):
    """Write-throughs committed to DRAM and not yet on storage."""

    entries: int
    bytes: int
    limit_bytes: int
    deferred: int


class WriterStats(msgspec.Struct):
    """The write-through processes."""

    processes: int
    started: int
    died: int
    start_failures: int
    unavailable: str | None  # why the last start failed, until one succeeds
    nice: int


class LimitStats(msgspec.Struct):
    """The limits on what one client holds, and what they refused or took back."""

    slot_timeout_s: float | None  # None: no time limit
    max_slot_bytes: int | None  # per client process; None: no cap
    max_held_bytes: int  # by one connection now
    capped_keys: int
    expired_reservations: int
    expired_leases: int
    max_user_slot_bytes: int | None = None  # per uid (all its processes); None: no cap


class NamespaceSummary(msgspec.Struct):
    """The namespaces in all, and the limits on them; `StoreStats.namespaces` may be one page."""

    total: int  # namespaces the server holds
    held: int  # of which registered by a client connected now
    refused: int  # registrations refused at a limit since the start
    max_desc_bytes: int | None  # the limits; None: none
    max_per_uid: int | None
    max_total: int | None
    next_after: str | None = None  # the page after this one starts past this id; None: no more


class NamespaceStats(msgspec.Struct):
    desc: str  # the NamespaceDesc as JSON
    lookups: int
    lookup_keys: int
    hit_keys_dram: int
    hit_keys_storage: int


class ClientStats(msgspec.Struct):
    id: int
    pid: int
    uid: int
    kind: str
    connected_s: float
    leases: int


class ServerInfo(msgspec.Struct):
    pid: int
    version: str
    protocol: int
    auto: bool  # started by a client, not by `hpkv server`
    uptime_s: float
    socket: str  # paths as `protocol.display_path` writes them
    pool_path: str
    storage_path: str


class StoreStats(msgspec.Struct):
    """The store's: its parts' snapshots, taken together."""

    store: StoreCounters
    dram: DramStats
    namespaces: dict[str, NamespaceStats]  # by namespace id: all, or one page (`namespace_summary`)
    namespace_summary: NamespaceSummary
    leases: int
    reservations: int
    limits: LimitStats
    quarantined: int
    holds: int
    write_backlog: WriteBacklogStats | None  # None: no storage tier
    storage: StorageStats | None  # None: no storage tier, or it is unusable
    storage_unusable: str | None  # why the storage tier is off though enabled
    writers: WriterStats | None  # None: writes in threads
    cluster: ClusterStats | None  # None: no cluster tier (off, or it cannot be used: `cluster_unusable`)
    cluster_unusable: str | None  # why the cluster tier is off though enabled


class ServerStats(StoreStats):
    """The whole snapshot: the store's fields first, then the server's (the wire's order)."""

    server: ServerInfo
    clients: list[ClientStats]


def from_wire(raw: Any) -> ServerStats:
    """The snapshot a client received; fields it does not know (a newer server's) are ignored."""
    try:
        return msgspec.convert(raw, ServerStats)
    except msgspec.ValidationError as exc:
        raise StatsMismatch(
            f"the server's stats do not match hpkv.stats: {exc}; run one hpkv version on both "
            "sides (restart the server after an upgrade)"
        ) from None


def from_parts(raw: Mapping[str, Any]) -> ServerStats:
    """The snapshot `raw` strictly: a field this schema lacks is an error too (what a test uses
    to check that a snapshot loses nothing on the way)."""
    stats = from_wire(raw)
    unknown = next(_unknown(raw, msgspec.to_builtins(stats), "$"), None)
    if unknown is not None:
        raise StatsMismatch(f"the server's stats have a field hpkv.stats lacks: {unknown}")
    return stats


def _unknown(raw: Any, known: Any, path: str) -> Iterator[str]:
    """The paths of the fields in `raw` that its conversion `known` dropped."""
    if isinstance(raw, Mapping) and isinstance(known, Mapping):
        for name, value in raw.items():
            if name not in known:
                yield f"{path}.{name}"
            else:
                yield from _unknown(value, known[name], f"{path}.{name}")
    elif isinstance(raw, list) and isinstance(known, list):
        for i, (value, kept) in enumerate(zip(raw, known, strict=False)):
            yield from _unknown(value, kept, f"{path}[{i}]")
