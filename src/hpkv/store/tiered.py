"""The tiered store: one DRAM pool and one storage tier behind a small in-process API.

Primitives (keyed by namespace `ns` and engine keys, in prefix order): `lookup`; `reserve` ->
`commit` | `abort`, or `reserve(..., hold=)` -> `settle`; `lease` -> `Lease.wait` -> `release`;
`join_owner`, `drop_owner`; `flush`, `clear`, `stats`, `close`. Each is its part's: `lookup.py` (namespaces,
lookups), `leases.py` (leases, promotions), `reservations.py` (reservations, holds, what is
taken back), `writethrough.py` (the backlog, flush, close); `limits.HeldSlots` keeps the books
of what each owner holds. The policies (`StorePolicy`) are given at construction.
Owns: the parts, the one lock that guards the DRAM index and every part's tables (file I/O runs
outside it), and the tiers' lifetime. The bytes are copied by callers through the mapped region.
Must not know: the protocol, clients beyond their owner ids.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import msgspec

from ..config import PoolConfig, StorageConfig
from ..fsinfo import MEMORY_FS, mount_of
from ..keys import NamespaceDesc
from ..limits import HeldSlots
from ..pool.region import PoolRegion
from ..pool.tier import DramEntry, DramTier
from ..stats import StoreCounters, StoreStats, zeroed
from ..storage.root import StorageUnusable
from ..storage.tier import StorageTier
from ..storage.writer import WriterPool
from ..tiers import Lookup
from .leases import Lease, Leases
from .lookup import Lookups
from .owners import NamespaceLimits
from .policies import StorePolicy
from .reservations import Reservations
from .writethrough import WriteThrough

log = logging.getLogger(__name__)


class TieredStore:
    STALLED_S = 30.0  # at close, give up the storage writes when none has ended for this long
    storage_unusable: str | None = None  # why the storage tier is off though enabled (`open`)

    def __init__(
        self,
        region: PoolRegion,
        storage: StorageTier | None,
        slab_bytes: int | None = None,
        write_processes: bool = False,
        policy: StorePolicy | None = None,
    ) -> None:
        policy = policy if policy is not None else StorePolicy()
        self.region = region
        self.storage = storage
        self.dram = DramTier(region.size_bytes, slab_bytes, room=policy.room, ready=lambda: region.ready_bytes)
        self.counters = zeroed(StoreCounters)
        self.held: HeldSlots[DramEntry] = HeldSlots()  # reservations by owner, and the limits the server sets
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
            self.held,
            self.counters,
            self.lookups,
            policy.order,
            reclaim=lambda: self.reservations.reclaim(),
        )
        self.reservations = Reservations(
            self._lock, self.dram, self.held, self.counters, self.leases, self.writes, policy.order
        )

    @classmethod
    def open(
        cls, pool: PoolConfig, storage: StorageConfig, slab_bytes: int | None = None, policy: StorePolicy | None = None
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
            store = cls(region, tier, slab_bytes, write_processes=True, policy=policy)
            store.storage_unusable = unusable
            return store
        except BaseException:
            if tier is not None:
                tier.close(wait=False)
            region.close()
            raise

    def close(self, abandon: threading.Event | None = None) -> bool:
        """Finish the write-throughs queued and deferred (entries committed from now on are not
        written: the pool goes), then remove the pool. The writes are given up (their entries are
        not on storage) once `abandon` is set, or when none has ended for STALLED_S, so a storage
        device that does not answer cannot keep the server, and the pool file the next server
        needs, for ever; the storage reads still queued are dropped then too (their promotions
        resolve as misses). Returns whether they were given up: threads may then still be stuck
        in a system call on that device, and the process should exit without joining them."""
        abandoned = self.writes.close(abandon, self.STALLED_S) if self.writes is not None else False
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

    def limit_namespaces(self, limits: NamespaceLimits) -> None:
        self.lookups.owners.limits = limits

    def namespaces(self) -> dict[str, NamespaceDesc]:
        return self.lookups.descs()

    def entry_bytes(self, ns: str) -> int:
        return self.dram.entry_bytes(ns)

    def lookup(self, ns: str, keys: Sequence[bytes]) -> Lookup:
        """The tier of each leading hit (DRAM before storage), up to the first miss."""
        return self.lookups.lookup(ns, keys)

    def lease(self, ns: str, keys: Sequence[bytes], owner: int = 0, start_reads: bool = True) -> Lease:
        return self.leases.lease(ns, keys, owner, start_reads)

    def release(self, lease_id: int) -> bool:
        return self.leases.release(lease_id)

    def reserve(self, ns: str, keys: Sequence[bytes], owner: int = 0, hold: str = "") -> list[int | None]:
        return self.reservations.reserve(ns, keys, owner, hold)

    def commit(self, ns: str, keys: Sequence[bytes], owner: int = 0) -> int:
        return self.reservations.commit(ns, keys, owner)

    def settle(self, hold: str, abort: set[bytes] | list[bytes] | None) -> tuple[int, int]:
        return self.reservations.settle(hold, abort)

    def abort(self, ns: str, keys: Sequence[bytes], owner: int = 0, hold: str = "") -> int:
        return self.reservations.abort(ns, keys, owner, hold)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the write-throughs queued so far, deferred ones included, are on storage
        (or have failed). False on timeout."""
        return self.writes.flush(timeout) if self.writes is not None else True

    def holds_reservations(self, owner: int) -> bool:
        with self._lock:
            return self.held.holds_reservations(owner)

    def join_owner(self, owner: int, uid: int, pid: int) -> None:
        """A client `owner` of process `pid`, user `uid`: its holdings count in their shares."""
        with self._lock:
            self.held.join(owner, uid, pid)

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
            self.held.leave(owner)

    def clear(self, dram: bool = True, storage: bool = False, ns: str | None = None) -> dict[str, int]:
        removed = {"dram": 0, "storage": 0}
        if dram:
            with self._lock:
                removed["dram"] = self.dram.drop(ns) if ns is None or self.lookups.known(ns) else 0
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
                reservations=self.held.num_reservations,
                limits=self.held.stats(),
                quarantined=len(self.held.quarantined),
                holds=len(self.held.holds),
                write_backlog=self.writes.stats() if self.writes is not None else None,
                storage=None,
                storage_unusable=self.storage_unusable,
                writers=None,
            )
        # Outside the lock: the storage tier and the writers keep their own.
        stats.storage = self.storage.stats() if self.storage is not None else None
        writers = self.writers
        stats.writers = writers.stats() if writers is not None else None
        return stats
