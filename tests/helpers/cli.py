"""`hpkv` on the command line against a real `hpkv server` process: the environment pointed at
test directories, the server as a child, and entries written as an engine worker writes them."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.env import without_hpkv
from hpkv.keys import NamespaceDesc
from hpkv.server.autostart import answers
from hpkv.server.client import Client
from hpkv.stats import ServerStats

HPKV_SCRIPT = Path(sys.executable).parent / "hpkv"
ENTRY_BYTES = 4096
DESC = NamespaceDesc(
    engine="vllm",
    model="Qwen/Qwen2.5-1.5B-Instruct",
    dtype="bfloat16",
    layout="nhd",
    block_size=16,
    num_layers=2,
    entry_bytes=ENTRY_BYTES,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hpkv_env(pool_dir: Path, storage_dir: Path, tmp_path: Path, **variables: str) -> dict[str, str]:
    """The current environment without HPKV settings, pointed at test directories."""
    env = without_hpkv()
    env.update(
        HPKV_SHARE_MEM_FILE_PATH=str(pool_dir),
        HPKV_KV_STORAGE_PATH=str(storage_dir),
        HPKV_KV_MEM_POOL_SIZE="64m",
        HPKV_CONFIG_FILE_PATH=str(tmp_path / "no-config.ini"),
        HPKV_METRICS_PORT="0",
        HPKV_IO_THREADS="2",
    )
    env.update(variables)
    return env


def hpkv(env: dict[str, str], *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([str(HPKV_SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)


class ServerProcess:
    """`hpkv server` as a child process; `stop()` sends SIGTERM and returns the exit status."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.pool_dir = Path(env["HPKV_SHARE_MEM_FILE_PATH"])
        self.socket = self.pool_dir / "hpkv.sock"
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(HPKV_SCRIPT), "server"], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        deadline = time.monotonic() + 20.0
        while not (answers(self.socket, timeout_s=0.2) and self._metrics_answer()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"hpkv server did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)

    def _metrics_answer(self) -> bool:
        """The metrics endpoint starts just after the socket: wait for it too, when it is on."""
        port = int(self.env.get("HPKV_METRICS_PORT", "0"))
        if not port:
            return True
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    def client(self, kind: str = "test-engine") -> Client:
        return Client(self.pool_dir, kind=kind, autostart=False)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text()


def write_entries(client: Client, num: int, desc: NamespaceDesc = DESC) -> tuple[str, list[bytes]]:
    """Register `desc` and save `num` entries through the pool, as an engine worker does."""
    ns = client.register(desc)
    keys = [bytes([i]) * 16 for i in range(num)]
    reservation = client.reserve(ns, keys)
    for i in range(num):
        reservation.view(i)[:] = bytes([i]) * desc.entry_bytes
    assert client.commit(reservation) == num
    return ns, keys


def wait_for_storage(client: Client, num_entries: int, timeout_s: float = 10.0) -> ServerStats:
    """Wait until the write-throughs are on storage; returns the stats then."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if stats.storage.num_entries >= num_entries or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def assert_demo_walk(out: str, engine: str, dram_step: str, storage: Path) -> None:
    """`hpkv demo`'s table: a DRAM hit and a storage hit, each identical to `engine`'s own, a row
    counting the KV files written, and the engine's start and restart reported."""
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in out.splitlines()
        if line.startswith("│")
    }
    dram = rows[dram_step]
    disk = rows["engine restarted, same request"]
    assert dram[0] == "DRAM" and int(dram[1]) > 1000 and dram[3] == "yes"
    assert disk[0] == "storage" and int(disk[1]) > 1000 and disk[3] == "yes"
    [(files, cells)] = [(name, cells) for name, cells in rows.items() if " KV files written under " in name]
    assert int(files.split()[0]) > 0 and cells[1] == "-"  # a file count in its own words, no hit tokens
    assert f"starting {engine}: done after" in out and f"restarting {engine}: done after" in out
    assert list(storage.rglob("*.kv"))
