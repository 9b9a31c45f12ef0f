"""The tiered store: one DRAM pool and one storage tier behind a small in-process API, the one
facade the server (its handlers and its daemon) goes through.

Primitives (keyed by namespace `ns` and engine keys, in prefix order): `create_store`; `register`,
`namespaces`, `check_desc_size`; `lookup`, `lookup_each`; `reserve` -> `commit` | `abort`, or
`reserve(..., hold=)` -> `settle`; `lease` (-> `Lease.start_reads`) -> `Lease.wait` (`get_lease`) ->
`release`; `join_owner`, `has_reservations`, `drop_owner`; `set_limits`; `flush`, `clear`,
`stats`, `close`; `region`, the mapped pool the bytes are copied through by callers; `watches`, the
part the server's `Journal` asks directly (`watches.py`: what entered and left the tiers). Each
is its part's: `lookup.py` (namespaces, lookups), `leases.py` (leases, promotions), `reservations.py`
(reservations, holds, what is taken back), `writethrough.py` (the backlog, flush, close),
`cluster.py` (the cluster tier: written through after commits, settles and promotions, asked by lookups);
`limits.SlotLimits` keeps the books of what each owner holds. Why one facade, of one-line
delegations mostly: every caller outside the package sees one API whose methods take the lock
where a part needs it, while the parts, one concept each, stay free to change (the batched
protocol reshapes them); below it the parts call the tiers (`DramTier`, `StorageTier`) directly,
with no layer between. The policies (`StorePolicy`) are given at construction.
Owns: the parts, the one lock that guards the DRAM index and every part's tables (file I/O runs
outside it), and the tiers' lifetime.
Must not know: the protocol, clients beyond their owner ids.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from ..cluster.client import ClusterUnavailable
from ..cluster.tier import ClusterTier
from ..config import ClusterConfig, PoolConfig, StorageConfig
from ..fsinfo import MEMORY_FS, mount_of
from ..keys import NamespaceDesc
from ..limits import SlotLimits, SlotShares, share_bytes
from ..pool.dram_tier import DramTier
from ..pool.entry import DramEntry
from ..pool.lru import PrefixOrder
from ..pool.region import PoolRegion
from ..pool.room import OldestFirst, RoomPolicy
from ..stats import StoreCounters, StoreStats, zeroed
from ..storage.root import StorageUnusable
from ..storage.storage_tier import StorageTier
from ..storage.writer import WriterPool
from ..tiers import Lookup
from .cluster import ClusterLink
from .leases import Lease, Leases
from .lookup import Lookups
from .owners import NamespaceLimits
from .reservations import Reservations
from .watches import Watches
from .writethrough import BACKLOG_LIMIT_SHARE, WriteThrough, backlog_limit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StorePolicy:
    """What a benchmark may vary, apart from the mechanism; the defaults are the store's own."""

    order: PrefixOrder = PrefixOrder.LAST_FIRST  # how entries used together reach the DRAM LRU
    room: RoomPolicy = field(default_factory=OldestFirst)  # how the DRAM tier finds room
    backlog_share: float = BACKLOG_LIMIT_SHARE  # of the pool; math.inf: no limit (all pinned)

    def backlog_limit(self, pool_bytes: int) -> float:
        """Payload bytes the write backlog may pin."""
        return backlog_limit(pool_bytes, self.backlog_share)


class TieredStore:
    STALLED_S = 30.0  # at close, give up the storage writes when none has ended for this long
    storage_unusable: str | None = None  # why the storage tier is off though enabled (`create_store`)
    cluster_unusable: str | None = None  # why the cluster tier is off though enabled (`create_store`)

    def __init__(
        self,
        region: PoolRegion,
        storage: StorageTier | None,
        slab_bytes: int | None = None,
        write_processes: bool = False,
        policy: StorePolicy | None = None,
        cluster: ClusterTier | None = None,
    ) -> None:
        policy = policy if policy is not None else StorePolicy()
        self.region = region
        self.storage = storage
        self.dram = DramTier(region.size_bytes, slab_bytes, room=policy.room, ready=lambda: region.ready_bytes)
        self.counters = zeroed(StoreCounters)
        self.limits: SlotLimits[DramEntry] = SlotLimits()  # reservations by owner, and the limits the server sets
        self._lock = threading.Lock()
        pool_bytes = self.dram.alloc.num_slabs * self.dram.alloc.slab_bytes
        # In process (no `write_processes`, or while no writer process can start) the writes run
        # on the write threads.
        self.writes = (
            None
            if storage is None
            else WriteThrough(
                self._lock, self.dram, storage, region, self.counters, policy.backlog_limit(pool_bytes), write_processes
            )
        )
        # The write-through processes (None in process, or without a storage tier).
        self.writers: WriterPool | None = self.writes.writers if self.writes is not None else None
        self.lookups = Lookups(self._lock, self.dram, storage, self.counters)
        self.leases = Leases(
            self._lock,
            self.dram,
            storage,
            region,
            self.limits,
            self.counters,
            self.lookups,
            policy.order,
            reclaim=lambda: self.reservations.reclaim(),
        )
        self.reservations = Reservations(
            self._lock, self.dram, self.limits, self.counters, self.leases, self.writes, policy.order
        )
        # The cluster tier (None: off): written through after commits, asked by lookups.
        self.cluster = (
            ClusterLink(self._lock, self.dram, cluster, lambda e, s: self.limits.quarantined.add(e, False, s))
            if cluster is not None
            else None
        )
        if self.cluster is not None:
            self.lookups.fill = self.cluster.fill
            self.leases.promoted = self.cluster.committed
        # What entered and left each tier, for the namespaces engines watch (their KV events).
        self.watches = Watches(self.dram, storage, self.lookups)

    def close(self, abandon: threading.Event | None = None) -> bool:
        """Finish the write-throughs queued and deferred (entries committed from now on are not
        written: the pool goes), then remove the pool. The writes are given up (their entries are
        not on storage) once `abandon` is set, or when none has ended for STALLED_S, so a storage
        device that does not answer cannot keep the server, and the pool file the next server
        needs, for ever; the storage reads still queued are dropped then too (their promotions
        resolve as misses). Returns whether they were given up: threads may then still be stuck
        in a system call on that device, and the process should exit without joining them."""
        abandoned = self.writes.close(abandon, self.STALLED_S) if self.writes is not None else False
        if self.cluster is not None:
            self.cluster.close()
        if self.storage is not None:
            self.storage.close(wait=not abandoned)
        self.region.close()
        return abandoned

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, desc: NamespaceDesc, owner: int = 0, uid: int | None = None) -> str:
        """The namespace of `desc`, held by `owner` (of `uid`) until `drop_owner(owner)`."""
        return self.lookups.register(desc, owner, uid)

    def set_limits(self, namespaces: NamespaceLimits | None = None, slots: SlotShares | None = None) -> None:
        """The server's limits: on namespaces, and on the slots each client takes (as shares of
        the pool); those not given stay as they are (a store starts with none)."""
        alloc = self.dram.alloc
        with self._lock:
            if namespaces is not None:
                self.lookups.owners.limits = namespaces
            if slots is not None:
                pool_bytes = alloc.num_slabs * alloc.slab_bytes
                self.limits.configure(
                    slots.timeout_s,
                    share_bytes(slots.process_share, pool_bytes, alloc.slab_bytes),
                    share_bytes(slots.user_share, pool_bytes, alloc.slab_bytes),
                )

    def namespaces(self) -> Mapping[str, NamespaceDesc]:
        """The namespaces registered: a read-only view, not a copy (asked on every request);
        copy it to iterate while clients may register."""
        return self.lookups.descs()

    def check_desc_size(self, desc_bytes: int) -> None:
        """`NamespaceLimit` where a description of `desc_bytes` is too large to register: asked
        before the description is parsed (its characters are at most its bytes)."""
        with self._lock:
            self.lookups.owners.check_size(desc_bytes)

    def lookup(self, ns: str, keys: Sequence[bytes]) -> Lookup:
        """The tier of each leading hit (DRAM before storage), up to the first miss."""
        return self.lookups.lookup(ns, keys)

    def lookup_each(self, ns: str, keys: Sequence[bytes]) -> bytes:
        """The tier of every key (`Tier` codes; 0: a miss), not only up to the first miss."""
        return self.lookups.lookup_each(ns, keys)

    def lease(self, ns: str, keys: Sequence[bytes], owner: int = 0, start_reads: bool = True) -> Lease:
        return self.leases.lease(ns, keys, owner, start_reads)

    def get_lease(self, lease_id: int) -> Lease | None:
        """The lease, while it is held (None once released or taken back at its time limit)."""
        return self.leases.get(lease_id)

    def release(self, lease_id: int) -> bool:
        return self.leases.release(lease_id)

    def reserve(self, ns: str, keys: Sequence[bytes], owner: int = 0, hold: str = "") -> list[int | None]:
        offsets = self.reservations.reserve(ns, keys, owner, hold)
        if self.cluster is not None and hold:
            self.cluster.reserved(hold, ns, keys)
        return offsets

    def commit(self, ns: str, keys: Sequence[bytes], owner: int = 0) -> int:
        num = self.reservations.commit(ns, keys, owner)
        if self.cluster is not None and num:
            self.cluster.committed(ns, keys)
        return num

    def settle(self, hold: str, abort: set[bytes] | list[bytes] | None) -> tuple[int, int]:
        settled = self.reservations.settle(hold, abort)
        if self.cluster is not None:
            self.cluster.settled(hold)
        return settled

    def abort(self, ns: str, keys: Sequence[bytes], owner: int = 0, hold: str = "") -> int:
        return self.reservations.abort(ns, keys, owner, hold)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the write-throughs queued so far, deferred ones included, are on storage
        (or have failed). False on timeout."""
        done = self.writes.flush(timeout) if self.writes is not None else True
        return (self.cluster.flush(timeout) if self.cluster is not None else True) and done

    def has_reservations(self, owner: int, hold: str | None = None) -> bool:
        """Whether `owner` holds reservations; with `hold`, reservations in that hold (until it
        is settled or times out)."""
        with self._lock:
            if hold is not None:
                return self.limits.holds.has(hold, owner)
            return self.limits.has_reservations(owner)

    def join_owner(self, owner: int, uid: int, pid: int) -> None:
        """A client `owner` of process `pid`, user `uid`: its holdings count in their shares."""
        with self._lock:
            self.limits.join(owner, uid, pid)

    def drop_owner(self, owner: int, quarantine_s: float = 0.0) -> None:
        """Abort the reservations and release the leases of a client that is gone, then forget
        the namespaces only it held that hold nothing now. With `quarantine_s`, its reserved
        slots stay unusable that long first: a client whose connection dropped while its process
        lives may still be copying into them."""
        with self._lock:
            self.reservations.drop_owner(owner, quarantine_s)
            lease_ids = self.leases.owned_by(owner)
        for lease_id in lease_ids:
            self.leases.release(lease_id)
        with self._lock:
            self.lookups.drop_owner(owner)
            self.limits.leave(owner)
        self.watches.drop_owner(owner)

    def clear(self, dram: bool = True, storage: bool = False, ns: str | None = None) -> dict[str, int]:
        """Remove entries; `dram` (memory) takes the cluster tier's objects (of `ns`) too."""
        removed = {"dram": 0, "storage": 0, "cluster": 0}
        if dram:
            with self._lock:
                removed["dram"] = self.dram.drop(ns) if ns is None or self.lookups.known(ns) else 0
            if self.cluster is not None:
                removed["cluster"] = self.cluster.tier.remove(ns)
        if storage and self.storage is not None:
            removed["storage"] = self.storage.remove(ns)
        return removed

    def stats(self) -> StoreStats:
        with self._lock:
            stats = StoreStats(
                store=msgspec.structs.replace(self.counters),  # a copy
                dram=self.dram.stats(self.region.backing_stats()),
                namespaces=self.lookups.stats(),
                namespace_summary=self.lookups.summary(),
                leases=len(self.leases),
                reservations=self.limits.num_reservations,
                limits=self.limits.stats(),
                quarantined=len(self.limits.quarantined),
                holds=len(self.limits.holds),
                write_backlog=self.writes.stats() if self.writes is not None else None,
                storage=None,
                storage_unusable=self.storage_unusable,
                writers=None,
                cluster=None,
                cluster_unusable=self.cluster_unusable,
            )
        # Outside the lock: the storage tier and the writers keep their own.
        stats.storage = self.storage.stats() if self.storage is not None else None
        writers = self.writers
        stats.writers = writers.stats() if writers is not None else None
        stats.cluster = self.cluster.stats() if self.cluster is not None else None
        return stats


def create_store(
    pool: PoolConfig,
    storage: StorageConfig,
    slab_bytes: int | None = None,
    policy: StorePolicy | None = None,
    cluster: ClusterConfig | None = None,
) -> TieredStore:
    """Create the pool file and start the storage tier (when enabled). A storage directory
    that cannot be used as it stands (`StorageUnusable`: read-only, not writable) leaves the
    store with its DRAM tier alone and `storage_unusable` saying why; a storage path that can
    never work (a pseudo file system) raises."""
    region = PoolRegion.create(pool.dir, pool.size_bytes)
    tier = None
    try:
        # Pages of a pool on ramfs not there yet arrive on first touch: storage on ramfs
        # must not take the memory they will need.
        unbacked = region.unbacked_bytes() if mount_of(pool.dir).fs_type in MEMORY_FS else 0
        unusable = None
        if storage.enabled:
            tier = StorageTier(storage)
            try:
                tier.start(promised_ram_bytes=unbacked)
            except StorageUnusable as exc:  # DRAM alone beats no server: said in the log, status, doctor
                tier.close(wait=False)
                tier, unusable = None, str(exc)
                log.warning(
                    "%s. Until then the server runs with the DRAM tier only: no KV is read from or "
                    "written to storage (fix it, then restart the server)",
                    exc,
                )
        cluster_tier, cluster_unusable = _cluster_tier(cluster, region)
        store = TieredStore(region, tier, slab_bytes, write_processes=True, policy=policy, cluster=cluster_tier)
        store.storage_unusable = unusable
        store.cluster_unusable = cluster_unusable
        return store
    except BaseException:
        if tier is not None:
            tier.close(wait=False)
        region.close()
        raise


def _cluster_tier(config: ClusterConfig | None, region: PoolRegion) -> tuple[ClusterTier | None, str | None]:
    """The cluster tier over the pool when it is on, or why it cannot be (the Mooncake client
    does not load here): then the server runs without it, as without a usable storage tier. A
    master not reachable yet is no such reason: the tier is a miss until it is."""
    if config is None or not config.enabled:
        return None, None
    tier = ClusterTier(config, region.buf)
    try:
        tier.start()
    except ClusterUnavailable as exc:
        log.warning("%s. Until then the server runs without the cluster tier", exc)
        return None, str(exc)
    return tier, None
