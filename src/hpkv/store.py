"""The tiered store: one DRAM pool and one storage tier behind a small in-process API.

Primitives (all keyed by namespace id `ns` and engine keys, in prefix order):
- `lookup(ns, keys)`: how many leading keys hit, and in which tier each (DRAM before storage).
- `reserve(ns, keys, owner)` -> pool offsets to copy into (None: skip this key), then
  `commit(ns, keys, owner)` publishes them and queues the write-through to storage, or
  `abort(ns, keys, owner)` gives the slots back. Uncommitted entries are invisible.
- `lease(ns, keys, owner)` pins the leading hits in DRAM, promoting storage hits into DRAM slots
  on the I/O threads; `Lease.wait()` says how many leading entries are ready to copy from.
  `release(lease_id)` lets them go. Leased entries are never evicted or overwritten.
- `reserve(..., hold=name)` puts the reservation in a hold instead: `settle(name, abort_keys)`
  commits every owner's part of it but the keys named, which are aborted (a hold not settled
  within HOLD_TIMEOUT_S is aborted whole).
- `drop_owner(owner)`: everything a vanished client held is aborted or released.
- Limits (`held`, `limits.HeldSlots`): a key past an owner's cap is not reserved or leased (a
  miss); a reservation or lease past its time limit is taken back, its slots quarantined first.
- `flush()` waits for queued write-throughs; `clear(memory, storage, ns)`, `stats()`, `close()`.
  An entry waiting for its write-through is pinned, up to BACKLOG_LIMIT_SHARE of the pool; past
  that it waits unpinned (deferred), and is written if the pool still holds it when its turn comes.

Thread-safe: one lock guards the DRAM index and the lease tables; file I/O runs outside it: reads
on the storage tier's threads, write-throughs on write threads of the store's own, each handing
its file to a writer process (`storage/writer.py`; in process when none can start, and in a
store built without `write_processes`). The bytes themselves are copied by callers through the
mapped region.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Callable

from .config import PoolConfig, StorageConfig
from .fsinfo import MEMORY_FS, mount_of
from .keys import NamespaceDesc
from .limits import HeldSlots
from .pool.region import PoolRegion
from .pool.tier import DramEntry, DramTier
from .storage.root import StorageUnusable
from .storage.tier import StorageTier
from .storage.writer import WriterPool, WriterUnavailable
from .types import HOLD_TIMEOUT_S, Lookup, Tier

log = logging.getLogger(__name__)

# Entries waiting for their write-through pin their pool slots, at most this share of the pool.
# Past it, a committed entry waits unpinned (`write_backlog["deferred"]`), evictable like any other,
# and is written once the backlog drains, if the pool still holds it. Without the limit a storage
# device slower than the engines pinned the whole pool, and every save after that was skipped.
BACKLOG_LIMIT_SHARE = 0.5
HOLD_QUARANTINE_S = 30.0  # then its slots (and all `held` takes back) stay unusable this long: a copy may go on


_NOWHERE = frozenset().__contains__  # the storage index of a store without a storage tier


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


@dataclass
class StoreCounters:
    lookups: int = 0
    lookup_keys: int = 0
    hit_keys_dram: int = 0
    hit_keys_storage: int = 0
    commits: int = 0
    aborts: int = 0
    skipped_present: int = 0
    leases: int = 0
    promotions: int = 0
    promotion_failures: int = 0
    write_through_skipped: int = 0
    write_through_deferred: int = 0
    write_through_lost: int = 0


class TieredStore:
    STALLED_S = 30.0  # at close, give up the storage writes when none has ended for this long
    storage_unusable: str | None = None  # why the storage tier is off though enabled (`open`)

    def __init__(self, region: PoolRegion, storage: StorageTier | None, slab_bytes: int | None = None,
                 write_processes: bool = False) -> None:
        self.region = region
        self.storage = storage
        self.dram = DramTier(region.size_bytes, slab_bytes)
        self.counters = StoreCounters()
        self._lock = threading.Lock()
        self._namespaces: dict[str, NamespaceDesc] = {}
        self._ns_hits: dict[str, list[int]] = {}  # ns -> [lookups, lookup keys, DRAM hits, storage hits]
        self.held = HeldSlots()  # reservations by owner, and the limits the server sets
        self._leases: dict[int, Lease] = {}
        self._promoting: dict[DramEntry, Future] = {}
        self._writes: set[Future] = set()
        # Entries committed and not written through yet (each pins its slot), and their payload bytes.
        self._backlog_entries = self._backlog_bytes = 0
        self._writes_ended = 0
        self._closing = False  # close() has begun: what is committed from now on is not written
        self._abandoned = False  # close() gave up the writes: write-throughs still running stop short
        self._backlog_limit = int(self.dram.alloc.num_slabs * self.dram.alloc.slab_bytes * BACKLOG_LIMIT_SHARE)
        # Committed entries past the limit, oldest first: written once the backlog drains, if still in DRAM.
        self._deferred: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._lease_ids = itertools.count(1)
        # Write-throughs run on threads of their own, so a promotion that a request waits for
        # never queues behind them; and on few of them: each waits for one writer process
        # (`storage/writer.py`), which does the work at a lower CPU priority and with a GIL of
        # its own. In process (`writers` None in tests, or while no writer process can start)
        # every busy thread competes for the GIL with the server's request handlers (a lookup
        # answered in 0.1 ms took 10 ms at p90 behind 8 write threads, 2 ms behind 2, on 2 cores).
        self._writer = None if storage is None else ThreadPoolExecutor(
            write_threads(storage.config.io_threads), thread_name_prefix="hpkv-write")
        self.writers = None if storage is None or not write_processes else WriterPool(
            region.share_fd(), write_threads(storage.config.io_threads), storage.config.write_nice)

    @classmethod
    def open(cls, pool: PoolConfig, storage: StorageConfig, slab_bytes: int | None = None) -> "TieredStore":
        """Create the pool file and start the storage tier (when enabled). A storage directory
        that cannot be used as it stands (`StorageUnusable`: read-only, not writable) leaves the
        store with its DRAM tier alone and `storage_unusable` saying why; a storage path that can
        never work (a pseudo file system) raises."""
        region = PoolRegion.create(pool.dir, pool.size_bytes)
        tier = None
        try:
            # A pool in memory whose pages are not there yet (on ramfs, where it may only be
            # sized): they arrive on first touch, the memory available still counts them, and
            # storage on ramfs must not take them too.
            unbacked = region.unbacked_bytes() if mount_of(pool.dir).fs_type in MEMORY_FS else 0
            unusable = None
            if storage.enabled:
                tier = StorageTier(storage)
                try:
                    tier.start(promised_ram_bytes=unbacked)
                except StorageUnusable as exc:  # DRAM alone beats no server: said in the log, status, doctor
                    tier.close(wait=False)
                    tier, unusable = None, str(exc)
                    log.warning("%s. Until then the server runs with the DRAM tier only: no KV is read from or "
                                "written to storage (fix it, then restart the server)", exc)
            store = cls(region, tier, slab_bytes, write_processes=True)
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
        not on storage) once `abandon` is set, or when none has ended for STALLED_S: a storage
        device that does not answer must not keep the server, and with it the pool file the next
        server needs, for ever; the storage reads still queued are dropped then too (their
        promotions resolve as misses). Returns whether they were given up: threads may then
        still be stuck in a system call on that device, and the process should exit without
        joining them (`os._exit`)."""
        with self._lock:
            self._closing = True
        if self._writer is not None:
            done, progress_at = self._writes_ended, time.monotonic()
            while not self.flush(timeout=0.2):
                if self._writes_ended != done:
                    done, progress_at = self._writes_ended, time.monotonic()
                stalled = time.monotonic() - progress_at > self.STALLED_S
                if stalled or (abandon is not None and abandon.is_set()):
                    self._abandon_writes(f"storage has finished no write for {self.STALLED_S:.0f} s" if stalled
                                         else "asked to stop again")
                    break
            self._writer.shutdown(wait=not self._abandoned)
        if self.writers is not None:
            self.writers.close()
        if self.storage is not None:
            self.storage.close(wait=not self._abandoned)
        self.region.close()
        return self._abandoned

    def _abandon_writes(self, why: str) -> None:
        with self._lock:
            self._abandoned = True
            waiting = self._backlog_entries + len(self._deferred)
            self.counters.write_through_lost += len(self._deferred)
            self._deferred.clear()
        self._writer.shutdown(wait=False, cancel_futures=True)
        if self.writers is not None:
            self.writers.kill()  # a job in hand fails at once, even on a device that does not answer
        log.warning("%s: stopping without writing the %d entries still waiting for storage (they are lost with "
                    "the pool)", why, waiting)

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def register(self, desc: NamespaceDesc) -> str:
        """The namespace of `desc`, known from now on; PoolError where the DRAM tier refuses it
        (an entry larger than a slab), and then nothing is written anywhere."""
        ns = desc.ns
        with self._lock:
            known = ns in self._namespaces
            if not known:
                self.dram.add_namespace(ns, desc.entry_bytes)  # refuses first: a refused ns leaves no file
        if not known and self.storage is not None:
            # File I/O (a hung network file system) outside the lock, which every client needs;
            # idempotent, so two engines registering at once both may.
            self.storage.add_namespace(ns, desc.to_json())
        with self._lock:
            if ns not in self._namespaces:
                self._namespaces[ns] = desc
                self._ns_hits[ns] = [0, 0, 0, 0]
        return ns

    def namespaces(self) -> dict[str, NamespaceDesc]:
        return dict(self._namespaces)

    def entry_bytes(self, ns: str) -> int:
        return self._namespaces[ns].entry_bytes

    # -- reads --------------------------------------------------------------------------------

    def lookup(self, ns: str, keys: list[bytes]) -> Lookup:
        tiers: list[Tier] = []
        index = self.dram.index_of(ns)
        prefix, on_storage = self.storage.index_probe(ns) if self.storage is not None else (b"", _NOWHERE)
        while True:
            with self._lock:
                for key in keys[len(tiers):] if tiers else keys:
                    entry = index.get(key)
                    if entry is not None and entry.ready:
                        tiers.append(Tier.DRAM)
                    elif on_storage(prefix + key):
                        tiers.append(Tier.STORAGE)
                    else:
                        break
            if not self._found_elsewhere(ns, keys, len(tiers)):
                break
        with self._lock:
            c = self.counters
            c.lookups += 1
            c.lookup_keys += len(keys)
            num_dram = tiers.count(Tier.DRAM)
            c.hit_keys_dram += num_dram
            c.hit_keys_storage += len(tiers) - num_dram
            per_ns = self._ns_hits[ns]
            per_ns[0] += 1
            per_ns[1] += len(keys)
            per_ns[2] += num_dram
            per_ns[3] += len(tiers) - num_dram
        return Lookup(tuple(tiers))

    def _found_elsewhere(self, ns: str, keys: list[bytes], i: int) -> bool:
        """Whether keys[i], where a walk of the indexes stopped, has a file on storage after all
        (another node wrote it, or the start-up scan has not reached it): the tier adopts it, and
        the walk goes on from there. Called without the lock: it is a `stat` on the storage
        device, a round trip on a network file system (or a hang), which under the lock would hold
        up every client of the store."""
        if self.storage is None or i >= len(keys):
            return False
        key = keys[i]
        if self.dram.get(ns, key) is not None or self.storage.indexed(ns, key):
            return False  # the walk stopped for another reason (an entry still being written, say)
        return self.storage.contains(ns, key)

    def lease(self, ns: str, keys: list[bytes], owner: int = 0, start_reads: bool = True) -> Lease:
        """Pin the leading hits; storage hits are read into DRAM slots in the background. With
        `start_reads=False` those reads wait for `start_reads(lease)`: a server answers first, so
        the I/O threads do not hold up the reply the caller (a scheduler) is waiting for."""
        entries: list[DramEntry] = []
        promotions: list[Future | None] = []
        reads: list[tuple[DramEntry, Future]] = []
        probe = self.storage.index_probe(ns) if self.storage is not None else (b"", _NOWHERE)
        num_touches = num_capped = 0
        slot_bytes = self.dram.slot_bytes(ns)
        while True:
            num_read = len(reads)
            with self._lock:
                self._reclaim()
                room = self.held.room(owner) - len(entries) * slot_bytes
                for key in keys[len(entries):] if entries else keys:
                    if room < slot_bytes:  # the rest is a miss: the caller recomputes it
                        num_capped = len(keys) - len(entries)
                        break
                    room -= slot_bytes
                    entry, promotion, read = self._pin_for_read(ns, key, probe)
                    if entry is None:
                        break
                    entries.append(entry)
                    promotions.append(promotion)
                    if read:
                        reads.append((entry, promotion))
            # Most recently used on storage now, so writes queued before their reads do not evict
            # them, before `_found_elsewhere` (a stat, slow on Lustre); last first, so the first
            # key is the last evicted (a lookup stops at the first miss). Outside the lock: the
            # tier's lock may be held for long (an eviction).
            if len(reads) > num_read:
                self.storage.touch(ns, [entry.key for entry, _ in reversed(reads[num_read:])])
                num_touches += 1
            if num_capped or not self._found_elsewhere(ns, keys, len(entries)):
                break
        if num_touches > 1:  # the first key last evicted across rounds too (no I/O)
            self.storage.touch(ns, [entry.key for entry, _ in reversed(reads)])
        with self._lock:
            lease = Lease(next(self._lease_ids), ns, owner, entries, promotions, reads, self.held.clock())
            self._leases[lease.id] = lease
            self.held.leased(owner, len(entries) * slot_bytes)
            self.counters.leases += 1
            self.held.refused(owner, num_capped, "leased")
        if start_reads:
            self.start_reads(lease)
        return lease

    def start_reads(self, lease: Lease) -> None:
        """Queue the storage reads of a lease's promotions (outside the lock: the I/O threads
        finishing earlier reads take it)."""
        reads, lease.reads = lease.reads, []
        for entry, promotion in reversed(reads):
            try:
                read = self.storage.submit(self._promote, entry, promotion)
            except RuntimeError:  # the executor is shut down: the store is closing
                self._promote_done(entry, promotion, False)
                continue
            read.add_done_callback(functools.partial(self._read_dropped, entry, promotion))

    def _read_dropped(self, entry: DramEntry, promotion: Future, read: Future) -> None:
        """A read cancelled before it ran (a close that gave up the storage I/O drops what is
        queued) never runs `_promote`: its promotion resolves here instead, as a miss."""
        if read.cancelled():
            self._promote_done(entry, promotion, False)

    def get_lease(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def release(self, lease_id: int) -> bool:
        """Unpin a lease's entries, last first. An entry is of use only behind every entry before
        it in its prefix (a lookup stops at the first miss), so of entries used together the
        last must be the first evicted, as vLLM frees its own blocks: unpinned last first, it
        is the oldest of them in the LRU. Commits, write-throughs (whose end unpins an entry)
        and promotions (whose reads refresh the storage tier's LRU) go last first too."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:  # released already, or taken back at the time limit
                return False
            for entry in reversed(lease.entries):
                self.dram.unpin(entry)
            self.held.released(lease.owner, sum(e.slot_bytes for e in lease.entries[:1]) * len(lease.entries))
        return True

    def _pin_for_read(self, ns: str, key: bytes, probe: tuple[bytes, Callable[[bytes], bool]]
                      ) -> tuple[DramEntry | None, Future | None, bool]:
        """(entry, its promotion or None, whether that promotion is new and must be queued);
        `probe`: the storage tier's `index_probe(ns)`."""
        entry = self.dram.get(ns, key)
        if entry is not None:
            promotion = self._promoting.get(entry)
            if not entry.ready and promotion is None:
                return None, None, False  # a writer is still copying it in
            self.dram.pin(entry)
            self.dram.touch(entry)
            return entry, promotion, False
        prefix, on_storage = probe
        if not on_storage(prefix + key):
            return None, None, False
        entry = self.dram.reserve(ns, key)
        if entry is None:
            return None, None, False
        self.dram.pin(entry)
        promotion: Future = Future()
        self._promoting[entry] = promotion
        self.counters.promotions += 1
        return entry, promotion, True

    def _promote(self, entry: DramEntry, promotion: Future) -> None:
        """Read one storage hit into its reserved slot. Whatever happens, the promotion resolves:
        its slot is reserved and readers may wait on it without a timeout."""
        ok = False
        try:
            view = self.region.view(entry.offset, self.entry_bytes(entry.ns))  # raises once the pool is closed
            try:
                ok = self.storage.read_into(entry.ns, entry.key, view)
            finally:
                view.release()
        except Exception:
            log.exception("promotion of an entry from storage failed; the request recomputes it")
        finally:
            self._promote_done(entry, promotion, ok)

    def _promote_done(self, entry: DramEntry, promotion: Future, ok: bool) -> None:
        with self._lock:
            del self._promoting[entry]
            if ok:
                ok = self.dram.commit(entry)
            else:
                self.dram.abort(entry)
                self.counters.promotion_failures += 1
        promotion.set_result(ok)

    # -- writes -------------------------------------------------------------------------------

    def reserve(self, ns: str, keys: list[bytes], owner: int = 0, hold: str = "") -> list[int | None]:
        """Slots to copy each key's bytes into; None where the key is already held (nothing is
        saved twice) or the pool has no slot that is not pinned. An owner is one writer: its
        reservations are its own until it commits or aborts them by key. A key the owner has
        reserved already (listed twice, or reserved again before its commit) gets None: the owner
        may still be copying into the first slot, which must stay its own until it commits or
        aborts, even if a clear dropped the entry meanwhile (in the same hold, with one). With
        `hold`, the keys reserved join that hold, and `settle` ends them, not the owner's commit
        or abort."""
        offsets: list[int | None] = []
        with self._lock:
            self._reclaim(hold)
            room, slot_bytes, num_capped = self.held.room(owner), self.dram.slot_bytes(ns), 0
            for key in keys:
                # A held one is not the owner's to commit. Its own name: an entry the name holds
                # already (a clear dropped it) would be lost for good if a second overwrote it.
                name = (ns, key, hold) if hold else (ns, key)
                if self.held.has(owner, name):
                    entry = None
                elif room < slot_bytes:
                    entry, num_capped = None, num_capped + 1
                else:
                    entry = self.dram.reserve(ns, key)
                if entry is None:
                    self.counters.skipped_present += 1
                    offsets.append(None)
                    continue
                self.held.add(owner, name, entry)
                room -= slot_bytes
                offsets.append(entry.offset)
            if hold:
                reserved = [key for key, offset in zip(keys, offsets) if offset is not None]
                if reserved:
                    self.held.join(hold, owner, ns, reserved)
            self.held.refused(owner, num_capped, "reserved")
        return offsets

    def settle(self, hold: str, abort: set[bytes] | list[bytes] | None) -> tuple[int, int]:
        """End a hold: commit every owner's reservations in it but the keys in `abort` (all of
        them when `abort` is None), which are aborted. Returns (published, aborted); reservations
        whose owner is gone meanwhile were aborted already and count in neither. Settling a hold
        that does not exist (settled already, or nothing was reserved in it) does nothing."""
        bad = None if abort is None else set(abort)
        num_published = num_aborted = 0
        writes: list[DramEntry] = []
        with self._lock:
            for owner, ns, keys in self.held.end_hold(hold):
                good = []
                for key in keys:
                    entry = self.held.pop(owner, (ns, key, hold))
                    if entry is not None and (bad is None or key in bad):
                        self.dram.abort(entry)
                        num_aborted += 1
                    else:
                        good.append(entry)
                num, more = self._publish(good)
                num_published += num
                writes += more
            self.counters.aborts += num_aborted
        self._submit_writes(writes)
        return num_published, num_aborted

    def _reclaim(self, joining: str = "") -> None:
        """Take back holds nobody settled within HOLD_TIMEOUT_S (but `joining`), reservations and
        leases past the clients' limit: quarantined first, as their holder may still be copying
        (a stalled process); and end the quarantines that are over. Caller holds the lock."""
        held = self.held
        expired = held.expired_holds(HOLD_TIMEOUT_S, joining) + [e for _, _, e in held.expired_reservations()]
        held.quarantine(expired, False, HOLD_QUARANTINE_S)
        self.counters.aborts += len(expired)
        for lease in held.expired_leases(self._leases):
            held.quarantine(reversed(lease.entries), True, HOLD_QUARANTINE_S)  # unpinned last first: see `release`
        for entry, leased in held.quarantine_over():
            self.dram.unpin(entry) if leased else self.dram.abort(entry)

    def commit(self, ns: str, keys: list[bytes], owner: int = 0) -> int:
        """Publish reserved keys and queue their write-through. Keys not reserved by `owner` are
        ignored. Returns the number published. Keys come in prefix order, and are published (and
        written through) last first: see `release`."""
        with self._lock:
            num, writes = self._publish([self.held.pop(owner, (ns, key)) for key in keys])
        self._submit_writes(writes)
        return num

    def _publish(self, entries: list[DramEntry | None]) -> tuple[int, list[DramEntry]]:
        """Commit reserved entries (in prefix order; published last first; None skipped): the
        number published (not dropped meanwhile) and the write-throughs to submit once the lock
        is let go. Caller holds the lock."""
        published, writes = 0, []
        for entry in reversed(entries):
            if entry is not None and self.dram.commit(entry):
                published += 1
                if self.storage is not None and self._admit_write(entry):
                    writes.append(entry)
        self.counters.commits += published
        return published, writes

    def _admit_write(self, entry: DramEntry) -> bool:
        """Into the backlog (pinned: the write-through reads the slot) if the backlog has room and
        nothing waits before it; else deferred. Caller holds the lock."""
        size = self.dram.entry_bytes(entry.ns)
        if self._closing:  # the pool goes with the server: nothing to write it for
            self.counters.write_through_lost += 1
            return False
        if self._backlog_entries and (self._deferred or self._backlog_bytes + size > self._backlog_limit):
            if (entry.ns, entry.key) not in self._deferred:  # evicted and committed again: once
                self._deferred[(entry.ns, entry.key)] = None
                self.counters.write_through_deferred += 1
            held = sum(len(self.dram.index_of(ns)) for ns in self._namespaces)
            if len(self._deferred) > 2 * held + 64:  # so at least half are gone from DRAM already
                self._prune_deferred()
            return False
        self.dram.pin(entry)
        self._backlog_entries += 1
        self._backlog_bytes += size
        return True

    def _prune_deferred(self) -> None:
        """Forget the deferred entries DRAM no longer holds. Caller holds the lock."""
        kept = OrderedDict((k, None) for k in self._deferred if k[1] in self.dram.index_of(k[0]))
        self.counters.write_through_lost += len(self._deferred) - len(kept)
        self._deferred = kept

    def _admit_deferred(self) -> list[DramEntry]:
        """The deferred entries the backlog has room for now, oldest first. Caller holds the lock."""
        admitted = []
        while self._deferred:
            ns, key = next(iter(self._deferred))
            if self._backlog_entries and self._backlog_bytes + self.dram.entry_bytes(ns) > self._backlog_limit:
                break
            del self._deferred[(ns, key)]
            entry = self.dram.index_of(ns).get(key)
            if entry is None:  # evicted or cleared before its turn: it was in DRAM only
                self.counters.write_through_lost += 1
                continue
            if not entry.ready:  # evicted and reserved again: its own commit writes it through
                continue
            self.dram.pin(entry)
            self._backlog_entries += 1
            self._backlog_bytes += self.dram.entry_bytes(ns)
            admitted.append(entry)
        return admitted

    def _submit_writes(self, entries: list[DramEntry]) -> None:
        todo = deque(entries)
        while todo:
            entry = todo.popleft()
            try:
                write = self._writer.submit(self._write_through, entry)
            except RuntimeError:  # the store is closed: the entry is not written
                with self._lock:
                    self.counters.write_through_lost += 1
                todo.extend(self._write_finished(entry))
                continue
            with self._lock:
                self._writes.add(write)
            write.add_done_callback(self._write_done)

    def _write_done(self, write: Future) -> None:
        with self._lock:
            self._writes.discard(write)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the write-throughs queued so far, deferred ones included, are on storage
        (or have failed). False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._writes)
            if not pending:
                return True
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if futures_wait(pending, left).not_done:
                return False

    def abort(self, ns: str, keys: list[bytes], owner: int = 0, hold: str = "") -> int:
        """Give back the slots of keys `owner` reserved (in `hold`, with one: an owner may give
        back what it reserved in a hold, never commit it); returns how many it held."""
        num = 0
        with self._lock:
            for key in keys:
                entry = self.held.pop(owner, (ns, key, hold) if hold else (ns, key))
                if entry is not None:
                    self.dram.abort(entry)
                    num += 1
            self.counters.aborts += num
        return num

    def _write_through(self, entry: DramEntry) -> None:
        try:
            if self._abandoned:
                return
            if self.storage.contains(entry.ns, entry.key):
                self.counters.write_through_skipped += 1
                return
            if self.writers is not None:
                try:
                    self._write_in_writer(entry)
                    return
                except WriterUnavailable:
                    if self._abandoned:  # the processes were killed: not written, and not here either
                        return
                    # said by the writer pool; this one is written here
            view = self.region.view(entry.offset, self.entry_bytes(entry.ns))
            try:
                self.storage.write_from(entry.ns, entry.key, view)
            finally:
                view.release()
        except Exception:
            log.exception("write-through to storage failed; the entry stays in DRAM only")
        finally:
            self._submit_writes(self._write_finished(entry))

    def _write_finished(self, entry: DramEntry) -> list[DramEntry]:
        """Out of the backlog; returns the deferred entries that now take its place."""
        with self._lock:
            self._writes_ended += 1
            self.dram.unpin(entry)
            self._backlog_entries -= 1
            self._backlog_bytes -= self.dram.entry_bytes(entry.ns)
            return self._admit_deferred()

    def _write_in_writer(self, entry: DramEntry) -> None:
        length, fsync, writers = self.entry_bytes(entry.ns), self.storage.config.fsync, self.writers
        version = self.storage.write_version(length)
        self.storage.publish(entry.ns, entry.key, length, version, lambda target: writers.write(
            entry.ns, entry.key, entry.offset, length, target, fsync, version))

    # -- owners, clearing, stats --------------------------------------------------------------

    def holds_reservations(self, owner: int) -> bool:
        with self._lock:
            return self.held.holds_reservations(owner)

    def drop_owner(self, owner: int, quarantine_s: float = 0.0) -> None:
        """Abort the reservations and release the leases of a client that is gone. With
        `quarantine_s`, its reserved slots stay unusable that long first: a client whose
        connection dropped (a timeout) while its process lives may still be copying into them,
        and those bytes must not land in an entry somebody else has reserved since."""
        with self._lock:
            reserved = self.held.pop_owner(owner)
            if quarantine_s > 0:
                self.held.quarantine(reserved, False, quarantine_s)
            else:
                for entry in reserved:
                    self.dram.abort(entry)
            self.counters.aborts += len(reserved)
            lease_ids = [i for i, lease in self._leases.items() if lease.owner == owner]
        for lease_id in lease_ids:
            self.release(lease_id)

    def clear(self, memory: bool = True, storage: bool = False, ns: str | None = None) -> dict[str, int]:
        removed = {"memory": 0, "storage": 0}
        if memory:
            with self._lock:
                removed["memory"] = self.dram.drop(ns) if ns is None or ns in self._namespaces else 0
        if storage and self.storage is not None:
            removed["storage"] = self.storage.remove(ns)
        return removed

    def stats(self) -> dict[str, object]:
        with self._lock:
            out: dict[str, object] = {"store": dict(vars(self.counters)), "dram": self.dram.stats()}
            out["dram"]["locked_in_memory"] = self.region.locked_in_memory
            out["namespaces"] = {
                ns: {"desc": desc.to_json(), "lookups": h[0], "lookup_keys": h[1], "hit_keys_dram": h[2],
                     "hit_keys_storage": h[3]}
                for ns, desc in self._namespaces.items() for h in [self._ns_hits[ns]]}
            out["leases"] = len(self._leases)
            out["reservations"] = self.held.num_reservations
            out["limits"] = self.held.stats()
            out["quarantined"] = self.held.num_quarantined
            out["holds"] = self.held.num_holds
            out["write_backlog"] = None if self.storage is None else {
                "entries": self._backlog_entries, "bytes": self._backlog_bytes, "limit_bytes": self._backlog_limit,
                "deferred": len(self._deferred)}
        out["storage"] = self.storage.stats() if self.storage is not None else None
        out["storage_unusable"] = self.storage_unusable
        writers = self.writers
        out["writers"] = writers.stats() if writers is not None else None
        return out


def write_threads(io_threads: int, cpus: int | None = None) -> int:
    """Threads for write-throughs: HPKV_IO_THREADS, at most a quarter of the CPUs (at least 2)."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(io_threads, max(2, cpus // 4)))
