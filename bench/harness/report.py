"""Timing and verdicts as every benchmark prints them. Primitives: `timed(fn, reps)` -> seconds per
call, `cpu_seconds(pids)` (CPU time the processes have run, all their threads), `median_p99_ms(times)`,
`verdict(passed)` -> "PASS"/"MISS", `log(message)` (progress, to stderr).
Targets are shown, never enforced: a benchmark reports."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds of each of `reps` calls of `fn`."""
    out = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def cpu_seconds(pids: Iterable[int]) -> float:
    """Seconds the processes' threads have run on a CPU (Linux schedstat, nanoseconds): unlike wall
    time, what other work on a shared machine takes from them does not count."""
    total = 0
    for pid in pids:
        tasks = f"/proc/{pid}/task"
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):  # a thread gone meanwhile
                pass
    return total / 1e9


def median_p99_ms(times: list[float]) -> tuple[float, float]:
    """(median, p99) of `times` (seconds), in milliseconds."""
    ordered = sorted(times)
    return statistics.median(ordered) * 1e3, ordered[int(len(ordered) * 0.99) - 1] * 1e3


def verdict(passed: bool) -> str:
    return "PASS" if passed else "MISS"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
