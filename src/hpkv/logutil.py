"""Rate-limited logging: when a record that repeats may be said again.

Owns the one rule every component uses for a warning that could repeat on every call (an I/O
error, a client at its cap, a bug on every engine step): said at most once per `interval_s` for
each kind, the rest left to DEBUG or counted. The caller passes the time and the interval at each
call, so an injected clock or a patched interval applies at once. Must not know what is logged.
"""

from __future__ import annotations

import math
from collections.abc import Hashable


class Throttle:
    """`allows(now, interval_s, kind)`: whether a record of `kind` may be said now; `quieted(kind)`:
    how many `allows` refused before the last one it allowed. Not locked: a race says one twice."""

    def __init__(self) -> None:
        self._said_at: dict[Hashable, float] = {}
        self._refused: dict[Hashable, int] = {}  # since the last one allowed
        self._quieted: dict[Hashable, int] = {}  # before the last one allowed

    def allows(self, now: float, interval_s: float, kind: Hashable = None) -> bool:
        if now - self._said_at.get(kind, -math.inf) < interval_s:
            self._refused[kind] = self._refused.get(kind, 0) + 1
            return False
        self._said_at[kind] = now
        self._quieted[kind] = self._refused.pop(kind, 0)
        return True

    def quieted(self, kind: Hashable = None) -> int:
        return self._quieted.get(kind, 0)
