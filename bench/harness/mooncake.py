"""Mooncake Store for the cluster tier's benchmarks, on 127.0.0.1: a real `mooncake_master` (the
binary the `cluster` extra installs, P2P handshake metadata: no HTTP metadata server) and this
node's segment process (`hpkv.cluster.segment`, as the server starts it).
Primitives: `start_master(work)` -> (process, address), `start_segment(work, config)` -> pid.
Must not know any one benchmark's rows.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from hpkv.config import ClusterConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master(work: Path) -> tuple[subprocess.Popen, str]:
    """A master on free ports, its log in `work`; once it listens: (process, "127.0.0.1:PORT")."""
    import mooncake.store

    binary = Path(mooncake.store.__file__).parent / "mooncake_master"
    port = free_port()
    argv = [str(binary), "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--rpc_thread_num=2"]
    argv += ["--metrics_host=127.0.0.1", f"--metrics_port={free_port()}"]
    with open(work / "master.log", "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("mooncake_master did not start")


def stop_master(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_segment(work: Path, config: ClusterConfig) -> int:
    """The segment process of `work` (a pool directory), once its segment is mounted: its pid.
    It outlives this process: `hpkv.cluster.segment.stop(work)` ends it."""
    from hpkv.cluster import segment

    segment.ensure(config, work, env=dict(os.environ))
    for _ in range(400):
        if (pid := segment.running(work)) not in (None, -1):
            return pid
        time.sleep(0.05)
    raise RuntimeError("the segment process did not mount its segment")
