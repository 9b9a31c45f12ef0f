"""Polling a condition until it holds, with a deadline: the one wait every test uses."""

from __future__ import annotations

import time


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.05, what: str = "condition"):
    """The first true value of `predicate()`; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s (last: {value!r})")
        time.sleep(interval_s)
