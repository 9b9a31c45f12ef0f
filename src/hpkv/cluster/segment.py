"""The process that contributes this node's segment to the cluster tier, apart from the server.

Objects live in the memory of the Mooncake client that contributed the segment holding them, and
go with that process. The HPKV server is not that process: it exits when idle (an auto-started
server) and restarts with its engines, and each time the node's share of the cluster would go.
So the server starts this process (`ensure`) if none runs for its pool directory, and leaves it
running when it exits; it lives until it is stopped (`stop`, `hpkv cluster stop`, SIGTERM) or
the machine restarts. One per pool directory: it holds an exclusive `flock` on
`cluster-segment.lock` there for its life, and a second one exits at once.
Owns: the segment's process, its lock and pid files.
Primitives: `ensure`, `running`, `stop`, `main` (`python -m hpkv.cluster.segment`).
Must not know: the store, the pool's slots.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..config import ClusterConfig
from .client import ClusterClient, ClusterUnavailable

log = logging.getLogger(__name__)

LOCK_NAME = "cluster-segment.lock"
PID_NAME = "cluster-segment.pid"  # written once the segment is mounted
RETRY_S = 2.0  # a master not there yet: set up again this often


def running(run_dir: Path) -> int | None:
    """The pid of this directory's segment process while one holds the lock, else None."""
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # held: it runs
        try:
            return int((run_dir / PID_NAME).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return -1  # starting: no segment mounted yet
    finally:
        os.close(fd)
    return None


def ensure(config: ClusterConfig, run_dir: Path, env: dict[str, str] | None = None) -> bool:
    """Start the segment process for `run_dir` unless one runs; whether one was started. It is
    a session of its own, so neither the server's exit nor a signal to its group ends it."""
    if config.segment_bytes <= 0 or running(run_dir) is not None:
        return False
    log_file = open(run_dir / "cluster-segment.log", "ab")
    try:
        subprocess.Popen(
            [sys.executable, "-m", "hpkv.cluster.segment", str(run_dir), json.dumps(dataclasses.asdict(config))],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            close_fds=True,
        )
    finally:
        log_file.close()
    return True


def stop(run_dir: Path, timeout_s: float = 10.0) -> bool:
    """SIGTERM the directory's segment process and wait for it; whether one was stopped. Its
    objects leave the cluster with it."""
    pid = running(run_dir)
    if pid is None or pid < 0:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while running(run_dir) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_dir, config = Path(argv[0]), ClusterConfig(**json.loads(argv[1]))
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another one holds the node's segment
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    client = ClusterClient(config, segment_bytes=config.segment_bytes)
    client.breaker.cooldown_s = client.breaker.max_cooldown_s = RETRY_S
    try:
        while not stopping.is_set() and not client.connect():
            stopping.wait(RETRY_S)
    except ClusterUnavailable as exc:  # no Mooncake here: said once, in its log
        log.error("%s", exc)
        return 1
    if client.connect():
        (run_dir / PID_NAME).write_text(f"{os.getpid()}\n")
        log.info("contributing %d bytes to the cluster at %s", config.segment_bytes, config.master)
    stopping.wait()
    (run_dir / PID_NAME).unlink(missing_ok=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
