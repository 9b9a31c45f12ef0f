"""A clock a story moves by hand (`now`, `advance`), given to what takes a clock: expiries and
rates without waiting in real time."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
