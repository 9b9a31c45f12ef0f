"""Eviction: removing the least recently used entry files until what this tier holds fits, while
sparing files other nodes read since this tier last used them.

Reads refresh a file's mtime on every node (at most every minute), so the order survives restarts
and is shared by nodes. Once this tier has seen another write to its directory (`shared`: it
adopted a file it did not write, or its root is on a file system other nodes mount), a victim's
mtime is looked at before it is removed (a `stat`, a round trip on a parallel file system, so
not before): one read elsewhere since the minute the index knew goes to the recent end instead.
At most SPARE_CHECKS_PER_PASS victims are looked at per eviction, each once, so an eviction ends.

Primitives: `Evictor.evict(excess)`, `evict_bytes`, `remove(victims)` (popped and looked at by
the caller: retention), `shared`, `may_unlink` (in a cluster: only the owner of a victim's part
unlinks it, and not while fenced; `parts`).
Must not know: capacity (it is told the excess), how files are read or written, the pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..stats import StorageCounters
from .index import FileIndex, Victims, size_of, used_minute_s
from .paths import EntryPaths

SPARE_CHECKS_PER_PASS = 16  # eviction victims whose mtime one eviction looks at
SLACK_MINUTES = 2  # a file read elsewhere since: its mtime this many minutes past the minute known


class Evictor:
    def __init__(
        self,
        index: FileIndex,
        paths: EntryPaths,
        counters: StorageCounters,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._index = index
        self._paths = paths
        self._counters = counters
        self._wall_clock = wall_clock
        self.shared = False  # another tier writes here too: victims are looked at first
        # In a cluster (`parts`): whether this node may unlink a victim now, asked just before.
        self.may_unlink: Callable[[bytes], bool] | None = None

    def evict_bytes(self, num_bytes: int) -> None:
        self.evict(lambda freed: num_bytes - freed)

    def evict(self, excess: Callable[[int], int]) -> None:
        """Evict the least recently used files while `excess(bytes freed so far)`, called with the
        index's lock held, is positive. Until its unlink a victim is a miss to lookups; one
        written again meanwhile is left in place."""
        freed = 0
        checked: set[bytes] = set()
        with self._index.busy():  # victims are held outside the index: their namespace numbers stay
            while True:
                victims, removals = self._index.pop_victims(excess, freed)
                spared, kept, num_freed = self._settle(victims, checked)
                freed += num_freed
                if not spared:
                    if kept:  # what it holds counts again: evict on
                        continue
                    return
                freed += self._index.put_back(spared, removals)

    def remove(self, victims: Victims) -> int:
        """Unlink victims the caller popped and looked at already (no spare check); bytes freed."""
        _, _, freed = self._settle(victims, {ik for ik, _ in victims})
        return freed

    def _settle(self, victims: Victims, checked: set[bytes]) -> tuple[Victims, bool, int]:
        """Unlink, spare or keep each victim: (the spared with their new values, whether one was
        written again since it was popped, bytes freed). Victims not settled when something
        raises go back into the index."""
        spared: Victims = []
        kept, freed = False, 0
        settled: set[bytes] = set()
        try:
            for ik, value in victims:
                if self.may_unlink is not None and not self.may_unlink(ik):
                    continue  # its part given away, or this node fenced, since it was popped: back in the index
                ns, key = self._index.split(ik)
                if self.shared and ik not in checked and len(checked) < SPARE_CHECKS_PER_PASS:
                    checked.add(ik)
                    used_s = self._used_since(ns, key, value)
                    if used_s is not None:  # known used now (later, where a clock is ahead: spared once)
                        spared.append((ik, self._index.value_of(size_of(value), max(used_s, self._wall_clock()))))
                        self._index.evicted(ik)
                        settled.add(ik)
                        continue
                if ik in self._index:  # written again since it was popped: unlinked, it would be a hit with no file
                    kept = True
                    self._index.evicted(ik)
                    settled.add(ik)
                    continue
                try:
                    self._paths.unlink(ns, key)
                except OSError:
                    pass  # another node evicted it first (or a link stands there: not followed)
                self._index.evicted(ik)
                settled.add(ik)
                freed += size_of(value)
                self._counters.evictions += 1
        finally:
            self._index.unpop([(ik, value) for ik, value in victims if ik not in settled])
        return spared, kept, freed

    def _used_since(self, ns: str, key: bytes, value: int) -> float | None:
        """The mtime of (ns, key)'s file where it is later than the minute `value` knows, with
        minutes to spare for clocks and for reads refreshing it at most every minute; else None."""
        try:
            mtime = self._paths.stat(ns, key).st_mtime
        except OSError:
            return None
        return mtime if mtime >= used_minute_s(value) + SLACK_MINUTES * 60 else None
