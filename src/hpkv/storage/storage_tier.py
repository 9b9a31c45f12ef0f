"""The storage tier: one checksummed file per entry, bounded, evicted LRU, shareable by nodes.

A facade over the concepts of the package: `paths` (where entry files live), `index` (what counts as
a hit, in LRU order), `capacity` (how much may be held; HPKV_KV_STORAGE_SIZE), `eviction`,
`reading`, `publishing`, `startup` (the index rebuilt from the start-up `scan`), `rescan` (other
nodes' files learned by walking again), `budget` (HPKV_KV_STORAGE_WRITE_BUDGET), `retention`
(HPKV_KV_STORAGE_RETENTION: a thread of passes). Files are immutable once published; a reader sees a whole file or
none, checked, and a bad file is a miss that deletes it; nothing below the root is followed
(`tree`). Several tiers (nodes) may share one root: a lookup adopts files others wrote.

Primitives: `remove_without_tier` (`hpkv clear --storage` with no server), `start`, `add_namespace`,
`pin_namespace`, `indexed` (`index_probe`), `contains`, `touch`/`done_with`, `read_into`,
`write_from` (or `publish`/`publish_many`, where another process writes the files), `submit`, `remove`, `stats`,
`close`; `watch`, the tier journal's hook on the index. A write that cannot happen is dropped (counted), never raised.
Why a facade: everything outside the package (the store, `hpkv clear`, benchmarks) goes through
these methods, in the (ns, key) words of the store, and the parts stay the package's to change;
the few that delegate in one line (`read_into`, `write_from`, `publish`, `publish_many`) keep
`Reader` and `Publisher` out of the store's sight. The parts (`paths`, `index`, `capacity`,
`evictor`, `reader`, `publisher`, `rescan`) are attributes for the package's own tests, with no
property passing them through.
Must not know: the pool, engines, devices.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..config import StorageConfig
from ..stats import StorageCounters, StorageStats
from . import root as storage_root
from . import scan, startup, tree
from .budget import WriteBudget
from .capacity import CapacityPolicy
from .cluster import Cluster
from .eviction import Evictor
from .fileio import FileIO, FileTarget, direct_supported
from .index import FileIndex
from .members import Timing
from .paths import EntryPaths
from .publishing import Publisher
from .reading import ErrorLog, MissCache, Reader
from .rescan import Rescan, shared_root
from .retention import Retention
from .usage import ClusterFiles

log = logging.getLogger(__name__)


def remove_without_tier(config: StorageConfig, ns: str | None = None) -> int:
    """What `StorageTier.remove` does, with no tier running (`hpkv clear --storage` without a
    server): delete every entry file (of `ns`) below the root, opened once as `start` opens it
    (StorageError, StorageUnusable as there), and where nodes share the root as a cluster
    (`<root>/cluster` exists) replace the clear epoch, so every owner forgets and lists its
    parts again. The number removed. No index, no start-up scan, and no lease: a clear that
    joined the cluster would take parts from the others for a moment (held off from evicting in
    them for the hold after it left), pass over the parts it took, and, first in a new root,
    write its own capacity into `cluster/config` for every server after it."""
    root = Path(config.path)
    storage_root.prepare(root)
    paths = EntryPaths(root, FileIO())
    try:
        paths.tree.fd()  # opened once: a root replaced from now on is not followed
        num = scan.remove_entries(paths.tree, ns)
        try:
            ClusterFiles(paths.tree, paths.io, paths.temp_name, create=False).bump_epoch()
        except FileNotFoundError:
            pass  # never shared as a cluster: no owner to tell
        except OSError as exc:
            log.warning("cannot mark the clear under %s for the other nodes: %s", root, exc)
        return num
    finally:
        paths.close()


class StorageTier:
    def __init__(
        self,
        config: StorageConfig,
        io: FileIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock`: the monotonic time of expiries (unreadable marks, a learned capacity, the
        budget, repeated warnings); `wall_clock`: the time of last uses (the index, retention);
        tests pass fake ones."""
        self.root = Path(config.path)
        self.config = config
        self.counters = StorageCounters()
        self.scan_done = threading.Event()
        self.budget = WriteBudget(config.write_budget_bytes, clock)
        self.paths = EntryPaths(self.root, io or FileIO())
        self.index = FileIndex(str(self.root), clock, wall_clock)
        self.capacity = CapacityPolicy(self.root, config.capacity_bytes, clock)
        errors = ErrorLog(clock)
        self.evictor = Evictor(self.index, self.paths, self.counters, wall_clock)
        self.retention = (
            Retention(config.retention_s, self.index, self.paths, self.evictor, wall_clock)
            if config.retention_s
            else None
        )
        self._stop = threading.Event()
        self._retention_thread: threading.Thread | None = None
        self._walk_soon = threading.Event()  # a read found an indexed file gone: walk the root soon (`rescan`)
        self.reader = Reader(self.paths, self.index, self.counters, errors, config.direct_io, self._walk_soon.set)
        self.publisher = Publisher(
            self.paths,
            self.index,
            self.capacity,
            self.evictor,
            self.reader,
            self.budget,
            self.counters,
            errors,
            config.fsync,
            self.scan_done,
        )
        self.rescan = Rescan(self.index, self.paths, self.evictor, self.capacity, self.counters, wall_clock)
        self._lock = self.index.lock  # held for long by evictions and removes
        self._shared_fs = False  # on a file system other nodes mount (`rescan`)
        self.cluster: Cluster | None = None  # the root's parts split among the nodes sharing it (`cluster`)
        self._clock, self._wall_clock = clock, wall_clock
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="hpkv-io")

    # -- life ---------------------------------------------------------------------------------

    def start(self, promised_ram_bytes: int = 0) -> None:
        """Make the root usable (`root.prepare`: StorageError, StorageUnusable where it is not),
        size the tier, and rebuild the index in the background.
        `promised_ram_bytes`: memory promised elsewhere and not taken yet (a DRAM pool on ramfs,
        whose pages arrive on first touch), which an automatic capacity on ramfs leaves out."""
        fs_type = storage_root.prepare(self.root)  # StorageUnusable: the server goes on with DRAM alone
        self.paths.tree.fd()  # the root opened once: nothing below it is looked up by its name again
        self.capacity.size_at_start(fs_type, promised_ram_bytes)
        if self.reader.direct and not direct_supported(str(self.root)):
            self.reader.direct = False
            log.warning(
                "the file system of %s does not take O_DIRECT (HPKV_KV_STORAGE_DIRECT_IO=on); KV files "
                "go through the page cache instead",
                self.root,
            )
        self._shared_fs = self.evictor.shared = shared_root(self.root)  # others read there too
        if self.config.cluster == "on" or (self.config.cluster == "auto" and self._shared_fs):
            self.cluster = Cluster(
                self.index,
                self.paths,
                self.evictor,
                self.capacity,
                self.counters,
                Timing(self.config.lease_s),
                self._wall_clock,
                self._clock,
            )
            self.reader.misses = MissCache(self._clock)
        threading.Thread(target=self._scan, name="hpkv-storage-scan", daemon=True).start()
        if self.retention is not None:
            args = (self._stop, self.scan_done)
            self._retention_thread = threading.Thread(
                target=self.retention.run, args=args, name="hpkv-storage-retention", daemon=True
            )
            self._retention_thread.start()

    def _scan(self) -> None:
        """The start-up scan, then the walks that learn other nodes' files (`rescan`); in a
        cluster, the first pass over this node's parts, then the cluster's ticks and passes."""
        if self.cluster is not None:
            try:
                self.cluster.join(self._stop)
                self.cluster.pass_once()
            except Exception:  # a thread's boundary: the cluster's thread tries again
                log.exception("joining the nodes sharing %s failed; trying again", self.root)
            self.scan_done.set()
            self.cluster.run(self._stop)
            return
        startup.rebuild(self.paths.tree, self.paths.node, self.index, self.capacity, self.evictor, self.counters)
        self.scan_done.set()
        self.rescan.run(self._shared_fs, self._stop, self._walk_soon)

    def close(self, wait: bool = True) -> None:
        """Finish queued writes, then stop the I/O threads; without `wait`, drop what is queued
        and do not wait for what runs (a device that does not answer)."""
        self._stop.set()
        self._walk_soon.set()  # wakes the walks' thread, which then sees `_stop`
        if wait and self._retention_thread is not None:
            self._retention_thread.join(timeout=10.0)  # a pass removes at most MAX_PER_PASS files
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        if self.cluster is not None and wait:  # else a pass may hold it in a system call: its lease expires
            try:
                self.cluster.leave()
            except OSError:
                pass  # its lease expires, and a live member reaps it
        if wait:  # else a thread may still be in a system call on it: the process is about to exit
            self.paths.close()

    def submit(self, fn: Callable, *args) -> Future:
        return self._executor.submit(fn, *args)

    def add_namespace(self, ns: str, description_json: str) -> None:
        """Keep the readable description beside the data. Best effort: a full disk must not stop
        the store from starting (the entries themselves do not need the description)."""
        try:
            tree.write_description(
                self.paths.tree, ns, "namespace.json", self.paths.temp_name("namespace"), description_json + "\n"
            )
        except OSError as exc:
            log.warning("cannot write %s: %s; going on without it", self.root / ns / "namespace.json", exc.strerror)

    def pin_namespace(self, ns: str, pinned: bool = True) -> None:
        """`ns` is registered: its index number stays until it is not `pinned` any more, and then
        goes once no file of it is indexed (no I/O)."""
        if pinned:
            self.index.numbers.pin(ns)
        else:
            self.index.numbers.unpin(ns)

    # -- lookups ------------------------------------------------------------------------------

    def indexed(self, ns: str, key: bytes) -> bool:
        """Whether (ns, key) is indexed: no I/O, so callers may ask while holding a lock."""
        return self.index.has(self.index.key(ns, key))

    def index_probe(self, ns: str) -> tuple[bytes, Callable[[bytes], bool]]:
        """(prefix, has): `has(prefix + key)` is `indexed(ns, key)` without a Python call per
        key, for walks over long prefixes."""
        return self.index.key(ns, b""), self.index.has

    def contains(self, ns: str, key: bytes) -> bool:
        """Whether a file for (ns, key) exists, adopting files other tiers wrote (one `lstat` of
        the file when the index does not hold it: ask without holding a lock); what stands
        there and is not a regular file is skipped and counted."""
        ik = self.index.key(ns, key)
        if self.index.has(ik):
            return True
        if self.index.being_evicted(ik):
            return False
        marked = ik in self.index.marks
        if marked and self.index.marks.is_marked(ik):
            return False
        if not self.reader.find_in_place(ns, key):  # used now: a lookup found it
            return False
        if not marked and self.scan_done.is_set():
            self.evictor.shared = True  # a file this tier did not write (not one of its own the scan has yet to find)
        return True

    def touch(self, ns: str, keys: list[bytes], in_use: bool = False) -> None:
        """Make the keys indexed the most recently used, in the order given (the last most
        recent): promotions are about to read them, and writes queued before those reads must
        not evict them. `in_use`: nor any eviction (however many files others put here) until
        `done_with` each. No I/O, but it waits for the index's lock, which an eviction or a
        `remove` holds for long: callers must hold no lock."""
        self.index.touch(self.index.key(ns, b""), keys, in_use)

    def done_with(self, ns: str, key: bytes) -> None:
        """The read `touch(..., in_use=True)` announced is done (or given up)."""
        self.index.in_use.done(self.index.key(ns, key))

    # -- I/O ----------------------------------------------------------------------------------

    def read_into(self, ns: str, key: bytes, dest: memoryview) -> bool:
        """Read and verify (ns, key) into `dest` (exactly the payload size); False is a miss, and
        `dest` must not be used then (`reading`)."""
        return self.reader.read_into(ns, key, dest)

    def write_version(self, payload_bytes: int) -> int:
        return self.publisher.write_version(payload_bytes)

    def write_from(self, ns: str, key: bytes, payload: memoryview) -> bool:
        """Publish `payload` as (ns, key) from this process; False when it was not written."""
        return self.publisher.write_from(ns, key, payload)

    def publish(
        self, ns: str, key: bytes, payload_bytes: int, version: int, write: Callable[[FileTarget], OSError | None]
    ) -> bool:
        """Make room for (ns, key) and have `write` put its file at a target named here
        (`publishing`); False when it was not written."""
        return self.publisher.publish(ns, key, payload_bytes, version, write)

    def publish_many(
        self,
        items: list[tuple[str, bytes, int, int]],
        write_many: Callable[[list[tuple[int, FileTarget]]], list[OSError | None]],
        write_one: Callable[[int, FileTarget], OSError | None],
    ) -> list[bool]:
        """`publish` for several (ns, key, payload_bytes, version), their first writes in one
        `write_many` call (`publishing`); whether each was published."""
        return self.publisher.publish_many(items, write_many, write_one)

    def watch(self, changes: Callable[[str, bytes, bool], None] | None) -> None:
        """Tell `changes(ns, key, stored)` of each file that enters or leaves the index (None: stop)."""
        with self.index.lock:  # the hook is called with it held
            self.index.numbers.changes = changes

    def remove(self, ns: str | None = None) -> int:
        """Delete every entry file (of one namespace), including files other nodes wrote; only
        inside the tree (`scan.remove_entries`). The number removed."""
        self.index.remove(ns)
        self.paths.tree.check()  # a root replaced: said, and not followed
        num = scan.remove_entries(self.paths.tree, ns)
        if self.cluster is not None:
            self.cluster.bump_epoch()  # the other nodes' owners forget what they knew and list again
        return num

    def stats(self) -> StorageStats:
        return StorageStats(
            capacity_bytes=self.capacity.capacity_bytes,
            used_bytes=self.index.used_bytes,
            num_entries=len(self.index),
            index_ready=self.scan_done.is_set(),
            direct_io=self.reader.direct,
            write_budget_bytes=self.config.write_budget_bytes,
            write_budget_available_bytes=self.budget.available(),
            **vars(self.counters),
            retention_s=self.config.retention_s,
            expired=self.retention.num_expired if self.retention is not None else 0,
            root_replaced=self.paths.tree.replaced,
            cluster=self.cluster.stats() if self.cluster is not None else None,
        )
