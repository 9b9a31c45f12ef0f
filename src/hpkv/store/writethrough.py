"""Write-through: committed entries written to the storage tier, the backlog they form, and the
way a closing store finishes or gives up those writes.

Owns: the write threads and the writer processes (`storage/writer.py`), the queue the threads
take batches from, the backlog (entries committed whose write, or that of one queued before
them, has not ended: each pins its slot, released in the order queued, so that a prefix becomes
evictable last entries first; their count and payload bytes), its limit, the deferred entries
(committed past the limit, oldest first: unpinned, written once the backlog drains if DRAM still
holds them), and the closing and abandoned flags; `BACKLOG_LIMIT_SHARE`, the share of the pool the
backlog may pin by default (`backlog_limit`).
Primitives: `admit` (caller holds the lock), `submit`, `flush`, `close`, `stats` (caller holds
the lock).
Must not know: leases, reservations, holds; who committed an entry.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from ..pool.dram_tier import DramTier
from ..pool.entry import DramEntry
from ..pool.region import PoolRegion
from ..stats import StoreCounters, WriteBacklogStats
from ..storage.fileio import FileTarget
from ..storage.storage_tier import StorageTier
from ..storage.writer import Job, WriterPool, WriterUnavailable

log = logging.getLogger(__name__)

# Entries waiting for their write-through pin their pool slots, at most this share of the pool;
# past it a committed entry waits unpinned (deferred): a storage device slower than the engines
# must not pin the whole pool.
BACKLOG_LIMIT_SHARE = 0.5


def backlog_limit(pool_bytes: int, share: float = BACKLOG_LIMIT_SHARE) -> float:
    """Payload bytes the write backlog may pin: `share` of the pool (math.inf: no limit)."""
    return math.inf if math.isinf(share) else int(pool_bytes * share)


BATCH_ENTRIES = 16  # written by one process in one round trip: the per-entry costs shared


def write_threads(io_threads: int, cpus: int | None = None) -> int:
    """Threads for write-throughs: HPKV_IO_THREADS, at most a quarter of the CPUs (at least 2)."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(io_threads, max(2, cpus // 4)))


class WriteThrough:
    def __init__(
        self,
        lock: threading.Lock,
        dram: DramTier,
        storage: StorageTier,
        region: PoolRegion,
        counters: StoreCounters,
        limit_bytes: float,
        write_processes: bool,
    ) -> None:
        self._lock = lock
        self._dram = dram
        self._storage = storage
        self._region = region
        self._counters = counters
        self.limit_bytes = limit_bytes
        self.num_entries = self.num_bytes = 0  # the backlog: pinned until their write, and those queued before, end
        self._deferred: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._queue: deque[list] = deque()  # [entry, written] admitted, not taken by a write thread yet
        # The backlog in the order queued, unpinned in that order as writes end (however the
        # threads' batches finish), so that a prefix's entries become evictable last first.
        self._order: deque[list] = deque()
        self._draining = 0  # write threads at work on the queue
        self._idle = threading.Condition(lock)  # the queue is empty and no thread works on it
        self._num_ended = 0
        self._closing = False  # what is committed from now on is not written
        self.abandoned = False  # the writes were given up: those still running stop short
        # Threads of their own, so a promotion a request waits for never queues behind a write;
        # few, each waiting for a writer process (own GIL, lower priority): in process, busy
        # threads compete for the GIL with the server's request handlers.
        threads = self._threads = write_threads(storage.config.io_threads)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="hpkv-write")
        self.writers = WriterPool(region.share_fd(), threads, storage.config.write_nice) if write_processes else None

    def admit(self, entry: DramEntry) -> bool:
        """Whether to submit a published entry's write now: into the backlog (pinned: the write
        reads the slot) if it has room and nothing waits before it; else deferred (or, while
        closing, lost). Caller holds the lock."""
        if self._closing:  # the pool goes with the server: nothing to write it for
            self._counters.write_through_lost += 1
            return False
        size = self._dram.entry_bytes(entry.ns)
        if self.num_entries and (self._deferred or self.num_bytes + size > self.limit_bytes):
            if (entry.ns, entry.key) not in self._deferred:  # evicted and committed again: once
                self._deferred[(entry.ns, entry.key)] = None
                self._counters.write_through_deferred += 1
            if len(self._deferred) > 2 * self._dram.num_entries + 64:  # so at least half are gone from DRAM
                self._prune_deferred()
            return False
        self._pin(entry)
        return True

    def _pin(self, entry: DramEntry) -> None:
        self._dram.pin(entry)
        self.num_entries += 1
        self.num_bytes += self._dram.entry_bytes(entry.ns)

    def _prune_deferred(self) -> None:
        """Forget the deferred entries DRAM no longer holds. Caller holds the lock."""
        kept = OrderedDict((k, None) for k in self._deferred if k[1] in self._dram.index_of(k[0]))
        self._counters.write_through_lost += len(self._deferred) - len(kept)
        self._deferred = kept

    def _admit_deferred(self) -> list[DramEntry]:
        """The deferred entries the backlog has room for now, oldest first. Caller holds the lock."""
        admitted = []
        while self._deferred:
            ns, key = next(iter(self._deferred))
            entry = self._dram.index_of(ns).get(key)  # its namespace may be gone with it
            size = self._dram.entry_bytes(ns) if entry is not None else 0
            if entry is not None and self.num_entries and self.num_bytes + size > self.limit_bytes:
                break
            del self._deferred[(ns, key)]
            if entry is None:  # evicted or cleared before its turn: it was in DRAM only
                self._counters.write_through_lost += 1
                continue
            if not entry.ready:  # evicted and reserved again: its own commit writes it through
                continue
            self._pin(entry)
            admitted.append(entry)
        return admitted

    def submit(self, entries: list[DramEntry]) -> None:
        """Queue the writes of entries `admit` took into the backlog (without the lock)."""
        with self._lock:
            records = [[entry, False] for entry in entries]
            self._queue.extend(records)
            self._order.extend(records)
            starts = min(self._threads - self._draining, len(self._queue))
            self._draining += starts
        for _ in range(starts):
            try:
                self._executor.submit(self._drain)
            except RuntimeError:  # the store is closed: what is queued is not written
                self._drop_queue()

    def _drop_queue(self) -> None:
        with self._lock:
            self._draining -= 1
            if self._draining:
                return  # a running drain takes them, or drops them when it ends
            dropped = list(self._queue)
            self._queue.clear()
            self._counters.write_through_lost += len(dropped)
            self._idle.notify_all()
        if dropped:
            self.submit(self._finished(dropped))  # their deferred successors go the same way

    def _drain(self) -> None:
        """Write queued entries, a batch at a time, until none is left."""
        while True:
            with self._lock:
                if not self._queue or self.abandoned:
                    self._draining -= 1
                    self._idle.notify_all()
                    return
                # Shared between the threads, so that every writer process has work.
                n = min(BATCH_ENTRIES, -(-len(self._queue) // self._threads))
                batch = [self._queue.popleft() for _ in range(n)]
            try:
                self._write_batch([entry for entry, _ in batch])
            finally:
                self.submit(self._finished(batch))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writes queued so far, deferred ones included, are on storage (or have
        failed, or were given up). False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self.abandoned or not (self._queue or self._draining), timeout)

    def _write_batch(self, batch: list[DramEntry]) -> None:
        todo, seen = [], set()
        for entry in batch:
            if self.abandoned:
                return
            if (entry.ns, entry.key) in seen or self._storage.contains(entry.ns, entry.key):
                self._counters.write_through_skipped += 1
                continue
            seen.add((entry.ns, entry.key))
            todo.append(entry)
        if self.writers is not None and todo:
            try:
                self._write_in_writers(todo)
                return
            except WriterUnavailable:
                if self.abandoned:  # the processes were killed: not written, and not here either
                    return
                # said by the writer pool; what it did not write is written here
                todo = [e for e in todo if not self._storage.indexed(e.ns, e.key)]
            except Exception:
                log.exception("write-through to storage failed; the entries stay in DRAM only")
                return
        for entry in todo:
            self._write_here(entry)

    def _write_here(self, entry: DramEntry) -> None:
        try:
            view = self._region.view(entry.offset, self._dram.entry_bytes(entry.ns))
            try:
                self._storage.write_from(entry.ns, entry.key, view)
            finally:
                view.release()
        except Exception:
            log.exception("write-through to storage failed; the entry stays in DRAM only")

    def _finished(self, records: list[list]) -> list[DramEntry]:
        """Out of the backlog; returns the deferred entries that now take their place."""
        with self._lock:
            for record in records:
                record[1] = True
                self._num_ended += 1
            while self._order and self._order[0][1]:
                entry = self._order.popleft()[0]
                self._dram.unpin(entry)
                self.num_entries -= 1
                self.num_bytes -= self._dram.entry_bytes(entry.ns)
            return self._admit_deferred()

    def _write_in_writers(self, entries: list[DramEntry]) -> None:
        fsync, writers, storage = self._storage.config.fsync, self.writers, self._storage
        assert writers is not None
        lengths = [self._dram.entry_bytes(e.ns) for e in entries]
        items = [(e.ns, e.key, n, storage.write_version(n)) for e, n in zip(entries, lengths, strict=True)]

        def job(i: int, target: FileTarget) -> Job:
            return Job(entries[i].ns, entries[i].key, entries[i].offset, lengths[i], target, items[i][3])

        storage.publish_many(
            items,
            lambda todo: writers.write_many([job(i, target) for i, target in todo], fsync),
            lambda i, target: writers.write_many([job(i, target)], fsync)[0],
        )

    def close(self, abandon: threading.Event | None, stalled_s: float) -> bool:
        """Finish the writes queued and deferred (entries committed from now on are not written),
        giving them up once `abandon` is set or when none has ended for `stalled_s`; stop the
        threads and processes. Returns whether the writes were given up."""
        with self._lock:
            self._closing = True
        done, progress_at = self._num_ended, time.monotonic()
        while not self.flush(timeout=0.2):
            if self._num_ended != done:
                done, progress_at = self._num_ended, time.monotonic()
            stalled = time.monotonic() - progress_at > stalled_s
            if stalled or (abandon is not None and abandon.is_set()):
                self._abandon(
                    f"storage has finished no write for {stalled_s:.0f} s" if stalled else "asked to stop again"
                )
                break
        self._executor.shutdown(wait=not self.abandoned)
        if self.writers is not None:
            self.writers.close()
        return self.abandoned

    def _abandon(self, why: str) -> None:
        with self._lock:
            self.abandoned = True
            waiting = self.num_entries + len(self._deferred)
            self._counters.write_through_lost += len(self._deferred)
            self._deferred.clear()
            self._idle.notify_all()  # flush returns: the writes are given up
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.writers is not None:
            self.writers.kill()  # a job in hand fails at once, even on a device that does not answer
        log.warning(
            "%s: stopping without writing the %d entries still waiting for storage (they are lost with the pool)",
            why,
            waiting,
        )

    def stats(self) -> WriteBacklogStats:
        """`stats().write_backlog`. Caller holds the lock."""
        # The limit is a whole number of bytes, or inf where a benchmark's policy lifts it.
        return WriteBacklogStats(
            entries=self.num_entries,
            bytes=self.num_bytes,
            limit_bytes=cast(int, self.limit_bytes),
            deferred=len(self._deferred),
        )
