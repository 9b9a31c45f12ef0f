"""An owner's pass over its parts: how a node in a shared root learns the files other nodes wrote
in the parts it owns (`parts`), instead of walking the whole root.

A pass lists the root for its namespaces, then, in each namespace, lists the first fan-out level
(`<ab>`) and `stat`s the leaf directory of each part this node owns under those there are (a part
given away during the pass, as its heartbeats see members join, is skipped from then on); it
lists those whose mtime changed since it listed them (an entry added or removed changes it),
and each once more at least MAX_LAG_S after such a listing before it trusts that mtime (a
listing that lagged, or a change within the mtime's granularity: seen by the second listing,
with no clock compared), and every one at least every RELIST_S; it `lstat`s each `.kv` name it
does not index and indexes it at the old end (known as used SLACK_MINUTES before the pass, as
the start-up scan does), and removes temporaries of dead writers there (`scan`). So its
operations are in proportion to the parts it owns and to what changed in them, never to the
files the other nodes own.

Then it forgets (never unlinks) files of parts it does not own beyond MAX_FOREIGN_FILES (it wrote
or read them; lookups find them again by name), evicts in its parts what is over its share of the
capacity (`capacity.share`), and writes its usage file (`usage`). A new clear epoch (`hpkv clear`
on any node) makes it forget everything and list its parts again.

Files removed by others in its parts (a reader on another node that found one bad, the previous
owner's evictions of files this node indexed before it gained the part, anything outside HPKV)
change their directory's mtime, so the next pass lists it: where the index holds more files of
that directory than the listing shows (`PartLedger.dir_files`), the pass `stat`s each indexed
file the listing lacks once it has looked at every part (one walk of the index, only then: a file
written since the listing is there) and forgets those gone (counted in `stale_entries`).

Primitives: `OwnerPass.once` -> `PassResult`, `OwnerPass.forget_parts`.
Must not know: how members are learned, how files are read or written, the pool.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..stats import StorageCounters
from . import scan, startup
from .capacity import CapacityPolicy
from .eviction import SLACK_MINUTES, Evictor
from .index import MAX_FILE_BYTES, FileIndex, used_minute_s
from .members import MAX_LAG_S
from .numbers import NS_ID_BYTES
from .parts import PartLedger
from .paths import EntryPaths
from .tree import DIR_FLAGS, open_beneath
from .usage import ClusterFiles

RELIST_S = 600.0
HEARTBEAT_PARTS = 64  # parts a pass looks at between two heartbeats (the membership's ticks)
MAX_FOREIGN_FILES = 1 << 16  # files of others' parts an index keeps (what this node wrote or read lately)


@dataclass
class PassResult:
    dirs_statted: int = 0  # leaf directories of its parts looked at
    dirs_listed: int = 0  # of which listed
    files_statted: int = 0  # names listed there that the index did not hold
    added: int = 0  # files indexed
    gone: int = 0  # indexed files found gone (removed by others) and forgotten


Suspects = dict[bytes, set[str]]  # leaf directory (`PartLedger.dir_key`) -> the names listed there


class OwnerPass:
    def __init__(
        self,
        index: FileIndex,
        paths: EntryPaths,
        ledger: PartLedger,
        evictor: Evictor,
        capacity: CapacityPolicy,
        files: ClusterFiles,
        counters: StorageCounters,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._index = index
        self._paths = paths
        self._ledger = ledger
        self._evictor = evictor
        self._capacity = capacity
        self._files = files
        self._counters = counters
        self._wall_clock = wall_clock
        self._clock = clock
        # (ns, part) -> (dir mtime_ns, when listed, whether a later listing saw that mtime still)
        self._listed: dict[tuple[str, int], tuple[int, float, bool]] = {}
        self._epoch: tuple[int, int] | None = None
        self._epoch_known = False

    def forget_parts(self, parts: np.ndarray) -> None:
        """Parts no longer this node's: listed afresh should they come back."""
        lost = set(parts.tolist())
        for k in [k for k in self._listed if k[1] in lost]:
            del self._listed[k]

    def once(self, heartbeat: Callable[[], object] = lambda: None) -> PassResult:
        """One pass (see the module docstring), calling `heartbeat` every HEARTBEAT_PARTS parts;
        the caller writes the usage (`usage`)."""
        self._check_epoch()
        result = PassResult()
        found = scan.Found()
        known_s = self._wall_clock() - SLACK_MINUTES * 60
        own = np.flatnonzero(self._ledger.owned).tolist()
        suspects: Suspects = {}  # directories where the index holds files the listing lacks
        with self._index.busy():  # what the pass found holds namespace numbers until it is merged
            for ns, ns_fd in self._namespaces():
                try:
                    tops = self._tops(ns_fd)
                    for num, part in enumerate(own):
                        if num % HEARTBEAT_PARTS == 0:
                            heartbeat()
                        if not self._ledger.owned[part]:
                            continue  # given away since the pass began (a heartbeat saw members join): its owner's now
                        if part >> 8 in tops:
                            self._part(ns, ns_fd, part, found, known_s, result, suspects)
                        else:
                            self._listed.pop((ns, part), None)
                finally:
                    os.close(ns_fd)
            startup.merge(self._index, found)
        result.added = len(found.keys)
        result.gone = self._forget_gone(suspects)
        if found.keys:
            self._evictor.shared = True
        self._trim_foreign()
        index, capacity = self._index, self._capacity
        self._evictor.evict(lambda freed: capacity.excess(index.counted_bytes))
        return result

    def usage(self) -> dict:
        ledger = self._ledger
        oldest = self._index.oldest()
        return {
            "parts": int(ledger.owned.sum()),
            "bytes": ledger.owned_bytes,
            "files": ledger.owned_files(),
            "oldest_use_s": used_minute_s(oldest[1]) if oldest is not None else None,
        }

    def _trim_foreign(self) -> None:
        """Forget (never unlink) the least recently used files of parts this node does not own
        past MAX_FOREIGN_FILES: a lookup finds them again by name; their owners manage them."""
        ledger, index = self._ledger, self._index
        over = ledger.foreign_files() - MAX_FOREIGN_FILES
        if over <= 0:
            return
        for ik, _ in index.items():
            if over <= 0:
                break
            if not ledger.is_owned(ik) and ik not in index.in_use:
                index.forget(ik)
                over -= 1

    def _check_epoch(self) -> None:
        epoch = self._files.epoch()
        if self._epoch_known and epoch != self._epoch:
            self._index.remove(None)  # cleared on some node: what this index knew is gone
            self._listed.clear()
        self._epoch, self._epoch_known = epoch, True

    def _namespaces(self):
        """(ns, descriptor) of each namespace directory under the root; the caller closes each."""
        root_fd = self._paths.tree.fd()
        try:
            entries = self._paths.io.list_dir(root_fd)
        except OSError:
            return
        for entry in entries:
            if scan.is_namespace(entry.name):
                try:
                    yield entry.name, open_beneath(root_fd, entry.name, DIR_FLAGS)
                except OSError:
                    continue

    def _tops(self, ns_fd: int) -> set[int]:
        """The first fan-out level's directories there are (`<ab>`): the parts under one that
        is missing need no `stat` (a root filling up, or a namespace with few files)."""
        try:
            return {int(e.name, 16) for e in self._paths.io.list_dir(ns_fd) if len(e.name) == 2 and _hex(e.name)}
        except OSError:
            return set(range(256))

    def _forget_gone(self, suspects: Suspects) -> int:
        """Forget the indexed files of the `suspects` directories that their listing lacked and
        a `stat` now finds gone (one walk of the index; none without suspects); how many."""
        if not suspects:
            return 0
        index, ledger, gone = self._index, self._ledger, 0
        for ik, _ in index.items():
            names = suspects.get(ledger.dir_key(ik))
            if names is None or f"{ik[NS_ID_BYTES:].hex()}.kv" in names or ik in index.in_use:
                continue
            try:
                self._paths.stat(*index.split(ik))
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR) and index.has(ik):
                    index.forget(ik)
                    gone += 1
        self._counters.stale_entries += gone
        return gone

    def _part(
        self, ns: str, ns_fd: int, part: int, found: scan.Found, known_s: float, result: PassResult, suspects: Suspects
    ) -> None:
        """Look at part `part`'s leaf directory in namespace `ns`: listed if it changed; a
        suspect if the index holds more of its files than the listing shows."""
        io = self._paths.io
        rel = f"{part >> 8:02x}/{part & 0xFF:02x}"
        result.dirs_statted += 1
        try:
            st = io.stat_path(rel, dir_fd=ns_fd)
        except OSError:
            self._listed.pop((ns, part), None)
            return
        now, mtime = self._clock(), st.st_mtime_ns
        last = self._listed.get((ns, part))
        if last is not None and last[0] == mtime and last[2] and now - last[1] < RELIST_S:
            return
        settled = last is not None and last[0] == mtime and now - last[1] >= MAX_LAG_S
        first = last is None or last[0] != mtime
        listed = (mtime, now if settled or first else last[1], settled)  # type: ignore[index]
        try:
            leaf_fd = open_beneath(ns_fd, rel, DIR_FLAGS)
        except OSError:
            return
        try:
            entries = io.list_dir(leaf_fd)
            result.dirs_listed += 1
            self._listed[(ns, part)] = listed
            known = sum(self._entry(ns, leaf_fd, entry, found, known_s, result) for entry in entries)
            ns_id = self._index.numbers.ids.get(ns)
            where = None if ns_id is None else ns_id + part.to_bytes(2, "big")
            if where is not None and self._ledger.dir_files(where) > known:
                suspects[where] = {entry.name for entry in entries}
        except OSError:
            pass
        finally:
            os.close(leaf_fd)

    def _entry(
        self, ns: str, leaf_fd: int, entry: os.DirEntry, found: scan.Found, known_s: float, result: PassResult
    ) -> bool:
        """Index the file of a name listed, if it is one this node does not index; whether the
        index holds it already."""
        name, index = entry.name, self._index
        if name.endswith(".tmp"):
            self._counters.temps_removed += scan.remove_temp_if_dead(leaf_fd, entry, self._paths.node)
            return False
        if not name.endswith(".kv"):
            return False
        try:
            ik = index.key(ns, bytes.fromhex(name[:-3]))
        except (ValueError, OSError):
            return False
        if index.has(ik):
            return True
        if ik in index.marks or index.being_evicted(ik):
            return False
        result.files_statted += 1
        try:
            st = self._paths.io.stat_path(name, dir_fd=leaf_fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ESTALE):
                raise
            return False
        if not stat.S_ISREG(st.st_mode):
            self._counters.untrusted_files += 1
            return False
        size = scan.counted_bytes(st, lambda: None) if st.st_size <= MAX_FILE_BYTES else None
        if size is None:
            return False
        found.mtimes.append(st.st_mtime)
        found.keys.append(ik)
        found.values.append(index.value_of(size, known_s))
        return False


def _hex(name: str) -> bool:
    return all(c in "0123456789abcdef" for c in name)
