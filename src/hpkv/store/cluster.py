"""The store's link to the cluster tier (`hpkv.cluster.tier.ClusterTier`): committed entries
written through to it, and keys missing from DRAM filled from it, in batches.

- Write-through: `committed(ns, keys)` (the facade calls it after a commit or a settle) queues
  the keys; one thread takes them in batches, pins those that DRAM holds published, asks the
  cluster which it lacks (one round trip), puts those from their slots, and unpins. The queue is
  bounded (`QUEUE_LIMIT` keys): past it keys are dropped (counted), so a slow cluster pins
  nothing and holds up no commit.
- Fill: `fill(ns, keys)` (the lookup calls it before its walk) asks the cluster, in one batch,
  for the keys after the leading DRAM hits up to the first key DRAM holds in any state; reserves
  slots for the leading run it holds; reads them straight into the slots; and publishes those
  verified, up to the first that is not (its slot and the rest's are given back, or kept from
  reuse a while where the read's transfer may still be running: `Read.UNSAFE`). The lookup's
  walk then finds them in DRAM: a cluster hit is served as a DRAM hit. Entries filled so are
  not written through again; entries promoted from storage are (the leases call `committed`:
  the cluster lacked them, or the fill would have found them first).
Owns: the write queue and its thread, the keys of the holds not settled yet (`reserved`).
Primitives: `reserved`, `committed`, `fill`, `flush`, `close`, `stats`.
Must not know: leases, reservations beyond the keys a hold reserved, the storage tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from ..cluster.tier import UNSAFE_KEEP_S, ClusterTier, Read
from ..pool.dram_tier import DramTier
from ..pool.entry import DramEntry
from ..stats import ClusterStats
from ..tiers import HOLD_TIMEOUT_S

log = logging.getLogger(__name__)

QUEUE_LIMIT = 65536  # keys waiting to be written to the cluster
BATCH = 32  # entries per put


class ClusterLink:
    def __init__(
        self,
        lock: threading.Lock,
        dram: DramTier,
        tier: ClusterTier,
        quarantine: Callable[[list[DramEntry], float], None],
    ) -> None:
        self._lock = lock  # the store's: the DRAM index
        self._dram = dram
        self.tier = tier
        # Reserved entries kept from reuse a while, then aborted (the store's quarantine): a read
        # whose transfer may still be running. Caller holds the lock.
        self._quarantine = lambda entries: quarantine(entries, UNSAFE_KEEP_S)
        self._queue: deque[tuple[str, bytes]] = deque()
        # hold -> (when first reserved, namespace -> keys): a hold spans namespaces (ranks, groups)
        self._holds: OrderedDict[str, tuple[float, dict[str, list[bytes]]]] = OrderedDict()
        self._wake = threading.Condition(threading.Lock())
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hpkv-cluster-write", daemon=True)
        self._thread.start()

    # -- write-through ---------------------------------------------------------------------

    def reserved(self, hold: str, ns: str, keys: Sequence[bytes]) -> None:
        """Keys reserved in `hold`: written once it is settled (those then published)."""
        now = time.monotonic()
        with self._wake:
            _, held = self._holds.setdefault(hold, (now, {}))
            held.setdefault(ns, []).extend(keys)
            while self._holds and now - next(iter(self._holds.values()))[0] > 2 * HOLD_TIMEOUT_S:
                self._holds.popitem(last=False)  # never settled: aborted by the store long since

    def settled(self, hold: str) -> None:
        with self._wake:
            _, held = self._holds.pop(hold, (0.0, {}))
        for ns, keys in held.items():
            self.committed(ns, keys)

    def committed(self, ns: str, keys: Sequence[bytes]) -> None:
        """Queue the keys just published (those DRAM no longer holds when their turn comes, or
        holds unpublished, are skipped)."""
        if not keys:
            return
        with self._wake:
            room = QUEUE_LIMIT - len(self._queue)
            self._queue.extend((ns, key) for key in keys[: max(room, 0)])
            dropped = len(keys) - max(min(room, len(keys)), 0)
            self._wake.notify()
        if dropped:
            self.tier.count(write_dropped=dropped)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._busy = False
                    self._wake.notify_all()
                    self._wake.wait()
                if self._closed:
                    self._busy = False
                    self._wake.notify_all()
                    return
                self._busy = True
                ns = self._queue[0][0]
                batch: list[bytes] = []
                while self._queue and self._queue[0][0] == ns and len(batch) < BATCH:
                    batch.append(self._queue.popleft()[1])
            try:
                self._write(ns, batch)
            except Exception:
                log.exception("cluster tier: write-through failed; the entries stay in this node's tiers")

    def _write(self, ns: str, keys: list[bytes]) -> None:
        with self._lock:
            entries = [
                e for key in dict.fromkeys(keys) if (e := self._dram.index_of(ns).get(key)) is not None and e.ready
            ]
            for entry in entries:
                self._dram.pin(entry)
            size = self._dram.entry_bytes(ns) if entries else 0
        try:
            found = self.tier.contains(ns, [e.key for e in entries]) if entries else []
            todo = [e for e, there in zip(entries, found) if not there]
            self.tier.write(ns, [(e.key, e.offset, size) for e in todo])
        finally:
            with self._lock:
                for entry in entries:
                    self._dram.unpin(entry)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the keys queued so far are written (or failed). False on timeout."""
        with self._wake:
            return self._wake.wait_for(lambda: self._closed or not (self._queue or self._busy), timeout)

    # -- fill ------------------------------------------------------------------------------

    def fill(self, ns: str, keys: Sequence[bytes]) -> int:
        """Read the cluster's objects of the keys after the leading DRAM hits into DRAM (see the
        module's doc); how many were published."""
        with self._lock:
            index = self._dram.index_of(ns)
            first = 0
            while first < len(keys) and (e := index.get(keys[first])) is not None and e.ready:
                first += 1
            last = first
            while last < len(keys) and keys[last] not in index:
                last += 1
        if last == first:
            return 0
        found = self.tier.contains(ns, keys[first:last])
        run = next((i for i, there in enumerate(found) if not there), len(found))
        if not run:
            return 0
        entries: list[DramEntry] = []
        with self._lock:
            if self._dram.index_of(ns) is not index:
                return 0  # the namespace went meanwhile
            size = self._dram.entry_bytes(ns)
            for key in keys[first : first + run]:
                entry = self._dram.reserve(ns, key)  # None: taken meanwhile, or no free slot
                if entry is None:
                    break
                entries.append(entry)
        reads: list[Read] | None = None
        try:
            reads = self.tier.read_into(ns, [(e.key, e.offset, size) for e in entries])
        finally:
            outcome = reads if reads is not None else [Read.UNSAFE] * len(entries)  # raised: unknown
            published, unsafe = 0, []
            with self._lock:
                for i, entry in enumerate(entries):
                    if outcome[i] is Read.UNSAFE:
                        unsafe.append(entry)  # its transfer may still write into the slot
                    elif outcome[i] is Read.HIT and i == published:
                        published += self._dram.commit(entry)  # False: dropped meanwhile (a clear), freed
                    else:
                        self._dram.abort(entry)
                if unsafe:
                    self._quarantine(unsafe)
        return published

    def stats(self) -> ClusterStats:
        return self.tier.stats()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=30)
        self.tier.close()
