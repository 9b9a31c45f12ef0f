"""The cluster tier's circuit breaker: after a few failures in a row the tier is skipped (every
call a miss, at no cost) for a while, then one call is let through to see whether the cluster is
back; each further failure doubles the wait, up to a limit.

Why: Mooncake's failures are slow (a call to a dead master takes about 4 s, a read from a dead
node about 1 s of a spinning core), and a sick cluster tier must not slow every lookup.
Owns: the state (closed, open until a time, one trial in flight), the counts of trips.
Primitives: `allow`, `succeeded`, `failed`, `is_open`.
Must not know: what is called.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Breaker:
    def __init__(
        self,
        threshold: int = 3,
        cooldown_s: float = 1.0,
        max_cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0  # in a row
        self._open_until: float | None = None  # None: closed
        self._wait_s = cooldown_s
        self._trial = False  # a call let through while open is in flight
        self.trips = 0

    def allow(self) -> bool:
        """Whether to make a call now: closed, or open past its wait with no trial in flight (this
        call is the trial)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._trial or self._clock() < self._open_until:
                return False
            self._trial = True
            return True

    def succeeded(self) -> None:
        with self._lock:
            self._failures = 0
            self._open_until = None
            self._wait_s = self.cooldown_s
            self._trial = False

    def failed(self) -> None:
        with self._lock:
            self._failures += 1
            if self._open_until is not None:  # the trial failed: wait longer
                self._wait_s = min(self._wait_s * 2, self.max_cooldown_s)
            elif self._failures < self.threshold:
                return
            else:
                self.trips += 1
            self._open_until = self._clock() + self._wait_s
            self._trial = False

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_until is not None
