"""Learning what other nodes did in a shared storage root: a walk of the root again and again
(`scan.walk`), so that each node's index, and so its capacity, counts every node's files, and the
nodes sharing a directory hold at most its capacity together.

A walk indexes the files this tier does not know (at the old end, oldest first, as the start-up
scan does: known as used SLACK_MINUTES before the walk, so a read elsewhere since spares one from
an eviction; counted for the blocks they take, `scan.counted_bytes`), forgets indexed files that
are gone (another node evicted or cleared them: one `stat` each, to tell a file gone from a
listing that lagged; counted in `stale_entries`), and evicts what is then over the capacity,
never an entry in use (`marks.InUse`). It runs where the root is on a file system other nodes
mount (`on_shared_fs`), or once a lookup has found a file another tier wrote (`Evictor.shared`),
every RESCAN_S, or RESCAN_COST_FACTOR times the last walk's duration where that is longer (a
large directory on a slow file system): between two walks, a node does not count what the others
wrote since. A read that finds an indexed file gone asks for a walk soon, wherever the root is
(another server on the same directory cleared it: the rest of the index is stale too).

Owns: `Rescan`, built by the storage tier from the parts a walk needs (the index, the entry paths,
the evictor, the capacity, the counters) and the tier's wall clock; `on_shared_fs`, `SHARED_FS`.
Primitives: `Rescan.once`, `Rescan.run`, `shared_root`, `on_shared_fs`.
Must not know: the tier, how files are read or written, the pool, engines.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..fsinfo import Mount, mount_of
from ..stats import StorageCounters
from . import scan, startup
from .capacity import CapacityPolicy
from .eviction import SLACK_MINUTES, Evictor
from .index import MAX_FILE_BYTES, FileIndex
from .paths import EntryPaths

log = logging.getLogger("hpkv.storage.tier")

RESCAN_S = 30.0
RESCAN_COST_FACTOR = 10.0
MIN_RESCAN_S = 1.0  # a walk asked for (`run`'s `soon`) comes no sooner than this after the last
# File systems other nodes mount: network, parallel and distributed ones.
SHARED_FS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "9p",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "fuse.ceph",
        "fuse.ceph-fuse",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.mfs",
        "fuse.moosefs",
        "fuse.juicefs",
        "fuse.3fs",
        "fuse.hf3fs",
        "weka",
        "wekafs",
    }
)


def on_shared_fs(mount: Mount) -> bool:
    """Whether other nodes may mount this file system (MooseFS says only "fuse"; its source,
    `mfs#host:port`, says more, the `#` escaped as in /proc/self/mountinfo)."""
    source = mount.source.replace("\\043", "#")
    return mount.fs_type in SHARED_FS or (mount.fs_type.startswith("fuse") and source.startswith("mfs#"))


def shared_root(root: Path) -> bool:
    try:
        return on_shared_fs(mount_of(root))
    except OSError:
        return False


class Rescan:
    """The walks of one tier's root, over the parts of that tier they need."""

    def __init__(
        self,
        index: FileIndex,
        paths: EntryPaths,
        evictor: Evictor,
        capacity: CapacityPolicy,
        counters: StorageCounters,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`wall_clock`: the tier's (file mtimes and the index's minutes are wall clock times)."""
        self._index = index
        self._paths = paths
        self._evictor = evictor
        self._capacity = capacity
        self._counters = counters
        self._wall_clock = wall_clock

    def once(self) -> tuple[int, int]:
        """One walk: (files of others indexed, indexed files found gone)."""
        with self._index.busy():  # what the walk found holds namespace numbers until it is merged
            added, gone = self._walk()
        index, capacity = self._index, self._capacity
        self._evictor.evict(lambda freed: capacity.excess(index.counted_bytes))
        return added, gone

    def _walk(self) -> tuple[int, int]:
        index = self._index
        before = {ik for ik, _ in index.items()}
        counters = StorageCounters()  # the tier's own count the start-up scan (`hpkv status`)
        known_s = self._wall_clock() - SLACK_MINUTES * 60
        found = scan.walk(
            self._paths.tree,
            self._paths.node,
            index.key,
            lambda size: index.value_of(size, known_s) if size <= MAX_FILE_BYTES else None,
            counters,
        )
        self._counters.temps_removed += counters.temps_removed
        new = scan.Found()
        for mtime, ik, value in zip(found.mtimes, found.keys, found.values):
            if ik not in before and ik not in index.marks and not index.being_evicted(ik):
                new.mtimes.append(mtime)
                new.keys.append(ik)
                new.values.append(value)
        startup.merge(index, new)
        gone = [ik for ik in before.difference(found.keys) if index.has(ik) and self._gone(ik)]
        for ik in gone:
            index.forget(ik)
        self._counters.stale_entries += len(gone)
        if new.keys:
            self._evictor.shared = True
        return len(new.keys), len(gone)

    def _gone(self, ik: bytes) -> bool:
        try:
            self._paths.stat(*self._index.split(ik))
        except OSError as exc:
            return exc.errno in (errno.ENOENT, errno.ENOTDIR)
        return False

    def run(self, shared_fs: bool, stop: threading.Event, soon: threading.Event) -> None:
        """Walk again every RESCAN_S (or longer, see above) until `stop`, while the root is on a
        shared file system or a lookup found another tier's file; and `soon` (set: a read found
        an indexed file gone, so others remove files here: the rest of the index may be stale
        too), at once, but no sooner after the last walk than RESCAN_COST_FACTOR times what it
        took (and MIN_RESCAN_S). Each period the root is checked against the one held
        (`tree.Root.check`: a replacement is said). Never raises: a walk that fails is said and
        tried again next time."""
        root = self._paths.root
        wait_s, took_s, ended = RESCAN_S, 0.0, time.monotonic()
        while True:
            soon.wait(wait_s)
            if stop.is_set():
                return
            if soon.is_set():
                stop.wait(max(0.0, ended + max(MIN_RESCAN_S, RESCAN_COST_FACTOR * took_s) - time.monotonic()))
                if stop.is_set():
                    return
            asked, wait_s = soon.is_set(), RESCAN_S
            soon.clear()
            self._paths.tree.check()
            if not (shared_fs or self._evictor.shared or asked):
                continue
            started = time.monotonic()
            try:
                added, gone = self.once()
            except Exception:  # a thread's boundary: the tier goes on without this walk
                log.exception("walking %s for other nodes' files failed; trying again later", root)
                continue
            ended = time.monotonic()
            took_s = ended - started
            wait_s = max(RESCAN_S, RESCAN_COST_FACTOR * took_s)
            if added or gone:
                log.debug("%s: %d files of other nodes indexed, %d gone, in %.2f s", root, added, gone, took_s)
