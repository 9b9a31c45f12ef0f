"""An engine's stop leaves no process of its group and no shared-memory segment behind.

vLLM's processes share Python `multiprocessing.shared_memory` segments (/dev/shm/psm_*, hundreds
of MiB each) that Python's resource tracker, a process of the same group, unlinks once every
process using them has gone. Here a real process group does the same on a small scale: a leader
serving HTTP and a forked worker, each with a segment of its own, and the tracker; it is stopped
by the real `EngineProcess.stop`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import pytest

from hpkv.demo import shm_orphans
from hpkv.demo.engine import EngineProcess, free_port, group_alive

# argv: port, file for the segments' names, what SIGTERM does ("ignore", or "slow": the worker
# takes a second to end, as vLLM's engine core does after its API server has exited).
GROUP = r"""
import http.server, multiprocessing, signal, sys, time
from multiprocessing import shared_memory
port, names, on_term = int(sys.argv[1]), sys.argv[2], sys.argv[3]

def segment():
    seg = shared_memory.SharedMemory(create=True, size=1 << 20)  # registered with the tracker
    with open(names, "a") as f:
        f.write(seg.name + "\n")
    return seg

def worker():
    seg = segment()
    if on_term == "slow":
        signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.0), sys.exit(0)))
    time.sleep(3600)

if on_term == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
seg = segment()
multiprocessing.get_context("fork").Process(target=worker).start()
while open(names).read().count("\n") < 2:
    time.sleep(0.01)
http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler).serve_forever()
"""

# Creates a segment, says its name, and keeps it mapped until killed.
HOLDER = r"""
import threading
import time
from multiprocessing import shared_memory
seg = shared_memory.SharedMemory(create=True, size=1 << 20)
print(seg.name, flush=True)
time.sleep(3600)
"""


class Group(EngineProcess):
    def __init__(self, workdir: Path, on_term: str) -> None:
        self.port, self.process, self.log_path = free_port(), None, workdir / "group.log"
        self.names_file, self.on_term = workdir / "names", on_term
        self.names_file.touch()

    def start(self, timeout_s: float = 60.0) -> Group:
        cmd = [sys.executable, "-c", GROUP, str(self.port), str(self.names_file), self.on_term]
        self._launch(cmd, {}, "/", "process group", timeout_s)
        return self

    def segments(self) -> list[Path]:
        return [shm_orphans.SHM_DIR / name for name in self.names_file.read_text().split()]


def test_a_group_that_needs_a_sigkill_leaves_no_segment_behind(tmp_path):
    group = Group(tmp_path, "ignore").start()
    segments = group.segments()
    assert len(segments) == 2 and all(p.exists() for p in segments)
    try:
        group.stop(timeout_s=1.0)  # SIGTERM is ignored: SIGKILL, the resource tracker with the rest
        assert not group_alive(group.process.pid)
        assert [p for p in segments if p.exists()] == []
    finally:
        for path in segments:
            path.unlink(missing_ok=True)


def test_stop_returns_once_the_whole_group_has_ended_and_cleaned_up(tmp_path):
    group = Group(tmp_path, "slow").start()
    segments = group.segments()
    try:
        group.stop()
        assert not group_alive(group.process.pid)  # the worker outlives the leader by a second
        assert [p for p in segments if p.exists()] == []
    finally:
        for path in segments:
            path.unlink(missing_ok=True)


def _holder() -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    return proc, shm_orphans.SHM_DIR / proc.stdout.readline().strip()


def test_only_segments_created_since_the_snapshot_and_held_by_no_process_are_removed():
    old = shared_memory.SharedMemory(create=True, size=1 << 20)  # older than the snapshot, unheld
    old.close()
    resource_tracker.unregister(old._name, "shared_memory")  # type: ignore[attr-defined]
    old_path = shm_orphans.SHM_DIR / old.name
    time.sleep(0.05)
    before, since = shm_orphans.snapshot(), time.time()
    held_proc, held = _holder()
    dead_proc, orphan = _holder()
    try:
        assert held.name in shm_orphans.in_use() and orphan.name in shm_orphans.in_use()
        os.killpg(dead_proc.pid, signal.SIGKILL)  # its resource tracker too: nobody unlinks it
        dead_proc.wait()
        assert orphan.exists() and orphan.name not in shm_orphans.in_use()

        removed = shm_orphans.remove_orphans(before, since)
        assert orphan in removed and not orphan.exists()
        assert held.exists() and old_path.exists()
        assert held not in removed and old_path not in removed
    finally:
        os.killpg(held_proc.pid, signal.SIGKILL)
        held_proc.wait()
        for path in (old_path, held, orphan):
            path.unlink(missing_ok=True)


def test_a_ctrl_c_while_the_engine_starts_stops_its_group(tmp_path):
    """Ctrl-C during a start (the demo's first minute): the engine, in a session of its own, does
    not get the SIGINT, so the start must stop it, or it runs on with its segments."""
    group = Group(tmp_path, "slow")
    group.port = free_port()  # nothing will answer there: the start waits until interrupted
    cmd_port = free_port()
    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            group._launch(
                [sys.executable, "-c", GROUP, str(cmd_port), str(group.names_file), "slow"], {}, "/", "group", 60
            )
        assert group.process is not None and not group_alive(group.process.pid)
        assert [p for p in group.segments() if p.exists()] == []
    finally:
        timer.cancel()
        if group.process is not None and group_alive(group.process.pid):
            os.killpg(group.process.pid, signal.SIGKILL)
        for path in group.segments():
            path.unlink(missing_ok=True)
