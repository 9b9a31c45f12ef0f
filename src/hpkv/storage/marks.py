"""Marks the storage index keeps on its keys beside their LRU order: files this tier cannot read
(`UnreadableMarks`: until a time, or for good) and files readers are about to read (`InUse`:
never eviction victims). Both share the index's lock.

Primitives: `UnreadableMarks.mark`, `unmark`, `is_marked`, `drop_prefixes`, `in`; `InUse.add`,
`done`, `in`, `len`.
Must not know: the LRU order, the file system, capacity.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from .numbers import NS_ID_BYTES

MAX_UNREADABLE = 1 << 20  # files this tier cannot read, remembered so that no lookup counts them as hits
NEVER = math.inf  # an unreadable mark for good

Clock = Callable[[], float]


class UnreadableMarks:
    """Files this tier cannot read, by index key: not adopted again by a lookup's `stat`, or
    every lookup would count them as hits that every read then misses. A mark holds until the
    clock passes its time (inf: for good), or until it is dropped (`unmark`: the key was written
    or read after all). Bounded: marks past their time go first, then, if that is not enough, all
    (those files are found again, one read each)."""

    def __init__(self, lock: threading.Lock, clock: Clock = time.monotonic, max_marks: int = MAX_UNREADABLE) -> None:
        self._lock = lock
        self._clock = clock
        self._max_marks = max_marks
        self._until: dict[bytes, float] = {}

    def __contains__(self, ik: bytes) -> bool:
        """Whether `ik` has a mark, past its time or not: no lock, no clock."""
        return ik in self._until

    def __iter__(self):
        return iter(list(self._until))

    def mark(self, ik: bytes, for_s: float) -> None:
        """Caller holds the lock."""
        now = self._clock()
        if len(self._until) >= self._max_marks:
            for k in [k for k, until in self._until.items() if until <= now]:
                del self._until[k]
            if len(self._until) >= self._max_marks:
                self._until.clear()
        self._until[ik] = now + for_s

    def drop_prefixes(self, prefixes: set[bytes]) -> None:
        """Drop the marks of keys of these namespace numbers (taken back). Caller holds the lock."""
        if self._until:
            for k in [k for k in self._until if k[:NS_ID_BYTES] in prefixes]:
                del self._until[k]

    def unmark(self, ik: bytes, locked: bool = False) -> None:
        if locked:
            self._until.pop(ik, None)
        else:
            with self._lock:
                self._until.pop(ik, None)

    def is_marked(self, ik: bytes, locked: bool = False) -> bool:
        """Whether `ik` is marked; a mark past its time is dropped, unless marked again
        meanwhile. `locked`: the caller holds the lock (else it is taken only to drop a mark)."""
        until = self._until.get(ik)
        if until is None:
            return False
        if until > self._clock():
            return True
        if locked:
            self._drop(ik, until)
        else:
            with self._lock:
                self._drop(ik, until)
        return False

    def _drop(self, ik: bytes, until: float) -> None:
        """Caller holds the lock."""
        if self._until.get(ik) == until:
            del self._until[ik]


class InUse:
    """Index keys readers are about to read, each with how many: never eviction victims. Shares
    the index's lock: `add` is called with it held."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._num: dict[bytes, int] = {}

    def __contains__(self, ik: bytes) -> bool:
        return ik in self._num

    def __len__(self) -> int:
        return len(self._num)

    def add(self, ik: bytes) -> None:
        """Caller holds the lock."""
        self._num[ik] = self._num.get(ik, 0) + 1

    def done(self, ik: bytes) -> None:
        """One reader `add` counted is done with `ik`."""
        with self._lock:
            num = self._num.get(ik, 0) - 1
            if num > 0:
                self._num[ik] = num
            else:
                self._num.pop(ik, None)
