"""Processes a test caused: whether one is alive, waiting for it to go, killing and stopping it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from helpers.waiting import wait_for


def alive(pid: int) -> bool:
    """True while `pid` exists and is neither a zombie nor dead."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    wait_for(lambda: not alive(pid), timeout_s, interval_s=0.02, what=f"process {pid} to exit")


def kill(pid: int | None, sig: int = signal.SIGKILL) -> None:
    """Signal `pid` if there is one; one already gone is no error."""
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every one of its threads is stopped (the kernel stops each
    thread as it next runs, so one may still answer a request after the signal)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue  # a thread that just ended
        if states and all(state in "tT" for state in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped after {timeout_s} s (thread states {states})")
        time.sleep(0.005)
