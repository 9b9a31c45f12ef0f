"""The storage tier's write budget (HPKV_KV_STORAGE_WRITE_BUDGET, bytes a day): a token bucket.

It holds BUDGET_BURST_S worth of the daily rate (bursts), full at start, and refills at that
rate. Primitives: `spend` (False: not that much left; said at most once per burst period),
`refund` (bytes of a write that did not happen), `available`. Thread-safe.
Must not know: files, the index, the pool.
"""

from __future__ import annotations

import logging
import math
import threading
import time

log = logging.getLogger("hpkv.storage.tier")

BUDGET_BURST_S = 3600.0  # the bucket holds this long's worth (bursts), full at start


class WriteBudget:
    def __init__(self, bytes_a_day: int | None, clock=time.monotonic) -> None:
        self.bytes_a_day = bytes_a_day
        self._clock = clock
        self._rate = None if bytes_a_day is None else bytes_a_day / 86400.0
        self._cap = 0.0 if bytes_a_day is None else bytes_a_day * BUDGET_BURST_S / 86400.0  # unused without a budget
        self._tokens = self._cap
        self._at = clock()
        self._warned_at = -math.inf
        self._lock = threading.Lock()

    def spend(self, size: int) -> bool:
        """Take `size` bytes; False when the bucket has not that much (nothing is taken)."""
        if self._rate is None:
            return True
        with self._lock:
            tokens = self._refill()
            if size <= tokens:
                self._tokens = tokens - size
                return True
            now = self._clock()
            if now - self._warned_at <= BUDGET_BURST_S:
                return False
            self._warned_at = now
        if size > self._cap:
            log.warning(
                "the storage write budget (HPKV_KV_STORAGE_WRITE_BUDGET=%d bytes a day) allows %d bytes an "
                "hour, less than one KV file of %d bytes: nothing is written to storage; raise the budget "
                "to at least %d",
                self.bytes_a_day,
                round(self._cap),
                size,
                math.ceil(size * 86400 / BUDGET_BURST_S),
            )
        else:
            log.warning(
                "the storage write budget (HPKV_KV_STORAGE_WRITE_BUDGET=%d bytes a day) is spent: new KV "
                "stays in DRAM only until it refills (%d bytes a second); said at most once an hour, "
                "counted in over_budget",
                self.bytes_a_day,
                round(self._rate),
            )
        return False

    def refund(self, size: int) -> None:
        """Give back what `spend` took for a write that did not happen."""
        if self._rate is None:
            return
        with self._lock:
            self._tokens = min(self._cap, self._refill() + size)

    def available(self) -> int | None:
        """Bytes that may be written now; None: no budget."""
        if self._rate is None:
            return None
        with self._lock:
            return int(self._refill())

    def _refill(self) -> float:
        """Caller holds the lock."""
        now = self._clock()
        self._tokens = min(self._cap, self._tokens + (now - self._at) * self._rate)
        self._at = now
        return self._tokens
