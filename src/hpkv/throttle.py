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
    """`allows(now, interval_s, kind)`: whether a record of `kind` may be said now;
    `num_refused(kind)`: how many `allows` refused since it last allowed one. Not locked: a race
    at worst says one record twice."""

    def __init__(self) -> None:
        self._said_at: dict[Hashable, float] = {}
        self._refused: dict[Hashable, int] = {}

    def allows(self, now: float, interval_s: float, kind: Hashable = None) -> bool:
        if now - self._said_at.get(kind, -math.inf) < interval_s:
            self._refused[kind] = self._refused.get(kind, 0) + 1
            return False
        self._said_at[kind] = now
        self._refused[kind] = 0
        return True

    def num_refused(self, kind: Hashable = None) -> int:
        return self._refused.get(kind, 0)
