"""Leases: entries pinned in DRAM for a reader, and the promotions that read storage hits into
DRAM slots for them.

Owns: the lease table (id -> `Lease`, oldest first), the promotions in flight (entry -> future),
the lease ids. A leased entry is never evicted or overwritten until `release` (or the time limit,
through `reclaim`) lets it go; a promotion always resolves (True: ready to copy from), so a
reader may wait on it without a timeout.
Primitives: `lease`, `start_reads`, `get`, `release`, `owned_by`, `take_expired`, `__len__`.
Must not know: reservations, holds, the write backlog; the limits are `SlotLimits`' (`held`).
Called without the store's lock, except `owned_by` and `take_expired` (caller holds it); the
storage I/O runs on the storage tier's threads, never under the lock.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..limits import SlotLimits
from ..pool.dram_tier import DramTier
from ..pool.entry import DramEntry
from ..pool.lru import PrefixOrder
from ..pool.region import PoolRegion
from ..stats import StoreCounters
from ..storage.storage_tier import StorageTier
from ..tiers import Tier
from .lookup import Lookups, Probe

log = logging.getLogger(__name__)
_DRAM, _STORAGE = int(Tier.DRAM), int(Tier.STORAGE)


@dataclass
class Lease:
    """Pinned entries for one reader. `offsets[i]` holds key i once `wait()` counts it ready."""

    id: int
    ns: str
    owner: int
    entries: list[DramEntry]
    promotions: list[Future | None]
    reads: list[tuple[DramEntry, Future]] = field(default_factory=list)  # not yet queued
    made_at: float = 0.0  # on the store's clock (`held.clock`)
    queue_reads: Callable[[Lease], None] | None = field(default=None, repr=False)  # `Leases.start_reads`
    offsets: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = [e.offset for e in self.entries]

    def wait(self, timeout: float | None = None) -> int:
        """Number of leading entries ready to copy from (promotions that failed end the run).
        `timeout` bounds the whole wait, not each promotion's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for num, promotion in enumerate(self.promotions):
            if promotion is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not promotion.result(left):
                return num
        return len(self.entries)

    @property
    def done(self) -> bool:
        return all(p is None or p.done() for p in self.promotions)

    def start_reads(self) -> None:
        """Queue the storage reads of a lease taken with `start_reads=False` (after its reply)."""
        if self.queue_reads is not None:
            self.queue_reads(self)

    @property
    def tiers(self) -> bytes:
        """Each leased entry's tier as the lease found it (`Tier` codes): DRAM, or storage when a
        promotion reads it into its slot."""
        return bytes(_DRAM if p is None else _STORAGE for p in self.promotions)


@dataclass
class _Pinned:
    """What a lease has pinned so far, across rounds of `Leases.lease`."""

    entries: list[DramEntry] = field(default_factory=list)
    promotions: list[Future | None] = field(default_factory=list)
    reads: list[tuple[DramEntry, Future]] = field(default_factory=list)


class Leases:
    def __init__(
        self,
        lock: threading.Lock,
        dram: DramTier,
        storage: StorageTier | None,
        region: PoolRegion,
        held: SlotLimits[DramEntry],
        counters: StoreCounters,
        lookups: Lookups,
        order: PrefixOrder,
        reclaim: Callable[[], None],
    ) -> None:
        self._lock = lock
        self._dram = dram
        self._storage = storage
        self._region = region
        self._held = held
        self._counters = counters
        self._lookups = lookups
        self._order = order
        self._reclaim = reclaim  # takes back what is held past its limit; caller holds the lock
        self._leases: dict[int, Lease] = {}
        self._promoting: dict[DramEntry, Future] = {}
        self._ids = itertools.count(1)
        # The cluster tier's hook (`store.cluster.ClusterLink.committed`, set by the store): an
        # entry promoted from storage is written to the cluster like one computed on this node.
        self.promoted: Callable[[str, Sequence[bytes]], None] = lambda ns, keys: None

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def _tier(self) -> StorageTier:
        """The storage tier, reached only for storage hits: there is one."""
        assert self._storage is not None
        return self._storage

    def lease(self, ns: str, keys: Sequence[bytes], owner: int = 0, start_reads: bool = True) -> Lease:
        """Pin the leading hits; storage hits are read into DRAM slots in the background. With
        `start_reads=False` those reads wait for `start_reads(lease)`: a server answers first, so
        the I/O threads do not hold up the reply the caller (a scheduler) is waiting for."""
        self._lookups.fill(ns, keys)  # the cluster tier's hits into DRAM first (a lease answers the tiers)
        pinned = _Pinned()
        probe = self._lookups.probe(ns)
        num_touches = 0
        slot_bytes = self._dram.slot_bytes(ns)
        while True:
            num_read = len(pinned.reads)
            num_capped = self._pin_round(ns, keys, owner, probe, pinned, slot_bytes)
            # Most recently used on storage now, and in use until read (`_promote_done`), so
            # neither writes queued before their reads nor other nodes' files evict them, before
            # `found_elsewhere` (a stat, slow on Lustre); last first, so the first key is the last
            # evicted (a lookup stops at the first miss). Outside the lock: the tier's lock may be
            # held for long (an eviction).
            if len(pinned.reads) > num_read:
                self._tier.touch(ns, [entry.key for entry, _ in reversed(pinned.reads[num_read:])], in_use=True)
                num_touches += 1
            if num_capped or not self._lookups.found_elsewhere(ns, keys, len(pinned.entries)):
                break
        if num_touches > 1:  # the first key last evicted across rounds too (no I/O)
            self._tier.touch(ns, [entry.key for entry, _ in reversed(pinned.reads)])
        with self._lock:
            lease = Lease(
                next(self._ids),
                ns,
                owner,
                pinned.entries,
                pinned.promotions,
                pinned.reads,
                self._held.clock(),
                self.start_reads,
            )
            self._leases[lease.id] = lease
            self._held.leased(owner, len(pinned.entries) * slot_bytes)
            self._counters.leases += 1
            self._held.refused(owner, num_capped, "leased")
        if start_reads:
            self.start_reads(lease)
        return lease

    def _pin_round(
        self, ns: str, keys: Sequence[bytes], owner: int, probe: Probe, pinned: _Pinned, slot_bytes: int
    ) -> int:
        """Pin the next keys up to a miss; the number of keys left past the owner's cap."""
        with self._lock:
            self._reclaim()
            room = self._held.room(owner) - len(pinned.entries) * slot_bytes
            for key in keys[len(pinned.entries) :] if pinned.entries else keys:
                if room < slot_bytes:  # the rest is a miss: the caller recomputes it
                    return len(keys) - len(pinned.entries)
                room -= slot_bytes
                entry, promotion, new = self._pin_for_read(ns, key, probe)
                if entry is None:
                    break
                pinned.entries.append(entry)
                pinned.promotions.append(promotion)
                if new is not None:
                    pinned.reads.append((entry, new))
        return 0

    def _pin_for_read(self, ns: str, key: bytes, probe: Probe) -> tuple[DramEntry | None, Future | None, Future | None]:
        """(entry, its promotion or None, that promotion again if it is new and must be queued).
        Caller holds the lock."""
        entry = self._dram.get(ns, key)
        if entry is not None:
            promotion = self._promoting.get(entry)
            if not entry.ready and promotion is None:
                return None, None, None  # a writer is still copying it in
            self._dram.pin(entry)
            self._dram.touch(entry)
            return entry, promotion, None
        prefix, on_storage = probe
        if not on_storage(prefix + key):
            return None, None, None
        entry = self._dram.reserve(ns, key)
        if entry is None:
            return None, None, None
        self._dram.pin(entry)
        new: Future = Future()
        self._promoting[entry] = new
        self._counters.promotions += 1
        return entry, new, new

    def start_reads(self, lease: Lease) -> None:
        """Queue the storage reads of a lease's promotions (outside the lock: the I/O threads
        finishing earlier reads take it)."""
        reads, lease.reads = lease.reads, []
        for entry, promotion in reversed(reads):
            try:
                read = self._tier.submit(self._promote, entry, promotion)
            except RuntimeError:  # the executor is shut down: the store is closing
                self._promote_done(entry, promotion, False)
                continue
            read.add_done_callback(functools.partial(self._read_dropped, entry, promotion))

    def _read_dropped(self, entry: DramEntry, promotion: Future, read: Future) -> None:
        """A read cancelled before it ran (a close that gave up the storage I/O drops what is
        queued) never runs `_promote`: its promotion resolves here instead, as a miss."""
        if read.cancelled():
            self._promote_done(entry, promotion, False)

    def _promote(self, entry: DramEntry, promotion: Future) -> None:
        """Read one storage hit into its reserved slot. Whatever happens, the promotion resolves:
        its slot is reserved and readers may wait on it without a timeout."""
        ok = False
        try:
            view = self._region.view(entry.offset, self._dram.entry_bytes(entry.ns))  # raises once the pool is closed
            try:
                ok = self._tier.read_into(entry.ns, entry.key, view)
            finally:
                view.release()
        except Exception:
            log.exception("promotion of an entry from storage failed; the request recomputes it")
        finally:
            self._promote_done(entry, promotion, ok)

    def _promote_done(self, entry: DramEntry, promotion: Future, ok: bool) -> None:
        self._tier.done_with(entry.ns, entry.key)
        with self._lock:
            del self._promoting[entry]
            if ok:
                ok = self._dram.commit(entry)
            else:
                self._dram.abort(entry)
                self._counters.promotion_failures += 1
        promotion.set_result(ok)
        if ok:
            self.promoted(entry.ns, (entry.key,))

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def release(self, lease_id: int) -> bool:
        """Unpin a lease's entries in the policy's order (last first: an entry is of use only
        behind every entry before it, so of entries used together the last must be the first
        evicted, as vLLM frees its own blocks). False if released already or taken back."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            for entry in self._order.arrange(lease.entries):
                self._dram.unpin(entry)
            self._held.released(lease.owner, sum(e.slot_bytes for e in lease.entries[:1]) * len(lease.entries))
        return True

    def owned_by(self, owner: int) -> list[int]:
        """Ids of the leases `owner` holds. Caller holds the lock."""
        return [i for i, lease in self._leases.items() if lease.owner == owner]

    def take_expired(self) -> list[Lease]:
        """The leases past the time limit, out of the table (their entries still pinned: the
        caller quarantines them). Caller holds the lock."""
        due = self._held.expired_leases(self._leases.values())
        for lease in due:
            del self._leases[lease.id]
        return due
