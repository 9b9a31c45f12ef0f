"""A real `mooncake_master` on 127.0.0.1 (free ports) for the cluster tier's tests, and the
fixture that starts and stops it. P2P handshake metadata (the tier's default), so no HTTP
metadata server is started (it would listen on 0.0.0.0 whatever it is told)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from helpers.cli import free_port


def master_binary() -> str:
    """The master the `cluster` extra installed: the binary inside the `mooncake` package (the
    console script `mooncake_master` only execs it)."""
    store = pytest.importorskip("mooncake.store", reason="the cluster extra (make setup) installs Mooncake")
    path = Path(store.__file__).parent / "mooncake_master"
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return str(path)


class MooncakeMaster:
    """One master process; `kill()` (SIGKILL) and `start()` again on the same port model a master
    that died and came back with no key (Mooncake keeps none across a restart)."""

    def __init__(self, log_path: Path, client_ttl_s: int = 3, lease_ttl_ms: int = 1000) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = log_path
        self.client_ttl_s = client_ttl_s
        self.lease_ttl_ms = lease_ttl_ms
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [
            master_binary(),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.port}",
            "--rpc_thread_num=2",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            f"--client_ttl={self.client_ttl_s}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: see {self.log_path}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"mooncake_master did not listen on {self.address} in 20 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()


@pytest.fixture
def mooncake_master(tmp_path):
    """A started `MooncakeMaster`, stopped after the test."""
    master = MooncakeMaster(tmp_path / "mooncake_master.log")
    master.start()
    yield master
    master.stop()
