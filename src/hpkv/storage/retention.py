"""Retention: entry files unused for longer than HPKV_KV_STORAGE_RETENTION are removed.

A file's last use is the later of the minute the index knows it used and its mtime (reads
refresh it on every node, at most every minute); a file the start-up scan found and nobody used
since is known by its mtime only (the scan files it all at one minute, `FileIndex.scan_known_s`,
in mtime order). A pass looks at the least recently used end of the index only: it removes files
from there while they are past the retention and stops at the first that is not, so it costs
one `stat` plus one `stat` and one `unlink` per file removed, never a walk of the tree; and it
looks at MAX_PER_PASS files at most, so a backlog after a long stop goes over several passes.

A file used since (on another node) goes to the recent end instead. Removal is the evictor's
(`Evictor.remove`): a file written again meanwhile stays.

Primitives: `Retention.expire_once()`, `run(stop, ready)` (a pass every `period_s` from `ready` until `stop`),
`period_s`, `num_expired`.
Must not know: capacity, how files are read or written, the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .eviction import Evictor
from .index import FileIndex, used_minute_s
from .paths import EntryPaths

log = logging.getLogger("hpkv.storage.tier")

MAX_PER_PASS = 4096  # files one pass looks at, at most
MAX_PERIOD_S = 60.0  # a pass at least this often (the index knows minutes)
MIN_PERIOD_S = 1.0


class Retention:
    def __init__(
        self,
        retention_s: float,
        index: FileIndex,
        paths: EntryPaths,
        evictor: Evictor,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.retention_s = retention_s
        self._index = index
        self._paths = paths
        self._evictor = evictor
        self._wall_clock = wall_clock
        self.num_expired = 0

    @property
    def period_s(self) -> float:
        return min(MAX_PERIOD_S, max(MIN_PERIOD_S, self.retention_s / 8))

    def expire_once(self) -> int:
        """Remove the least recently used files past the retention; the number removed."""
        cutoff_s = self._wall_clock() - self.retention_s
        num = 0
        with self._index.busy():  # the oldest is held outside the index: its namespace number stays
            num = self._expire(cutoff_s)
        self.num_expired += num
        return num

    def _expire(self, cutoff_s: float) -> int:
        num = 0
        for _ in range(MAX_PER_PASS):
            oldest = self._index.oldest()
            if oldest is None:
                break
            ik, value = oldest
            ledger = self._index.ledger
            if ledger is not None and not ledger.may_evict(ik):  # a cluster: not this node's to remove now
                if ledger.is_owned(ik):
                    break  # its part held off, or this node fenced: a later pass
                self._index.forget(ik)  # another node's to remove: a lookup finds it again by name
                continue
            scanned, own_s = self._own_use_s(value)
            mtime_s = self._mtime(ik)
            if max(own_s, mtime_s) < cutoff_s:
                if not self._index.pop_if_oldest(ik, value):
                    break  # used meanwhile, or in use: the next pass looks again
                self._evictor.remove([(ik, value)])
                num += 1
            elif own_s >= cutoff_s or scanned:
                break  # the oldest is in use: so is everything behind it
            else:
                self._index.refresh(ik, value, mtime_s)  # used elsewhere since: to the recent end
        return num

    def _own_use_s(self, value: int) -> tuple[bool, float]:
        """(known by the start-up scan only, the end of the minute this index knew it used)."""
        minute_s = used_minute_s(value)
        known_s = self._index.scan_known_s
        if known_s is not None and minute_s == known_s // 60 * 60:
            return True, 0.0  # the scan's time, not a use: its mtime says
        return False, minute_s + 60

    def run(self, stop: threading.Event, ready: threading.Event) -> None:
        """Passes every `period_s` once `ready` (the start-up scan) is set, until `stop` is."""
        while not ready.wait(self.period_s):
            if stop.is_set():
                return
        while not stop.is_set():
            try:
                num = self.expire_once()
            except Exception:  # a thread of the server: log, and try again next period
                log.exception("storage retention pass failed")
                num = 0
            if num:
                log.info("removed %d KV files unused for over %s s (HPKV_KV_STORAGE_RETENTION)", num, self.retention_s)
            stop.wait(self.period_s if num < MAX_PER_PASS // 2 else MIN_PERIOD_S)

    def _mtime(self, ik: bytes) -> float:
        ns, key = self._index.split(ik)
        try:
            return self._paths.stat(ns, key).st_mtime
        except OSError:
            return 0.0  # gone: removing it from the index is right
