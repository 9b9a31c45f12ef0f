"""LMCache's multi-process server as a child process: the peer the vLLM benchmarks compare with.

LMCache's in-process connector (LMCacheConnectorV1) does not run on a CPU; its multi-process mode
does: `lmcache server` owns an L1 DRAM cache and L2 adapters (here the `fs` adapter, files under
a directory), and vLLM's `LMCacheMPConnector` talks to it over ZMQ. On a CPU the connector moves
KV itself ("engine_driven"), through a shared-memory segment the server creates (`--shm-name`);
without one it would pickle every chunk through the socket.

Primitives: `LMCacheServer.start` / `stop` (the process group, and the shared-memory segment it
leaves in /dev/shm), `kv_transfer_config` (the vLLM flag value), `status` (its HTTP /status),
`l2_files` (what its L2 holds on disk). Usage tracking, metrics and the banner are off; both
sockets are bound to loopback. It knows nothing about vLLM beyond the connector's config keys.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from hpkv.demo.engine import free_port, wait_until_answers

QUIET_ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}


@dataclass
class LMCacheServer:
    l1_size_gb: float
    l2_dir: Path
    log_path: Path
    shm_name: str = field(default_factory=lambda: f"hpkv-peers-lmcache-{os.getpid()}")
    port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        lmcache = str(Path(sys.executable).with_name("lmcache"))
        return [
            lmcache,
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--l1-size-gb",
            str(self.l1_size_gb),
            "--eviction-policy",
            "LRU",
            "--l2-adapter",
            json.dumps({"type": "fs", "base_path": str(self.l2_dir)}),
            "--supported-transfer-mode",
            "engine_driven",
            "--shm-name",
            self.shm_name,
            "--disable-observability",
            "--disable-metrics",
        ]

    def kv_transfer_config(self) -> str:
        return json.dumps(
            {
                "kv_connector": "LMCacheMPConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port},
            }
        )

    def start(self, timeout_s: float = 120.0) -> LMCacheServer:
        self.l2_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        # Its own session, so stop() can end the server and every helper it forks at once.
        self.process = subprocess.Popen(
            self.command(),
            env={**os.environ, **QUIET_ENV},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        try:
            wait_until_answers(self.process, self.url("/healthcheck"), timeout_s, "lmcache server", self.log_path, 0.5)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # A killed server leaves its segment behind; the next one must create a fresh one.
        Path("/dev/shm", self.shm_name).unlink(missing_ok=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def status(self) -> dict:
        return json.loads(urllib.request.urlopen(self.url("/status"), timeout=30).read())

    def l2_files(self) -> tuple[int, int]:
        """(files, bytes) under the L2 directory: chunks written through to disk."""
        sizes = []
        for path in self.l2_dir.rglob("*.data"):
            try:
                sizes.append(path.stat().st_size)
            except FileNotFoundError:  # removed while listed
                pass
        return len(sizes), sum(sizes)

    def wait_l2_settled(self, quiet_s: float = 2.0, timeout_s: float = 120.0) -> tuple[int, int]:
        """L2 writes are asynchronous: wait until the directory stops growing, so a restart finds
        everything the L1 hits saw stored."""
        deadline = time.monotonic() + timeout_s
        last, since = self.l2_files(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.l2_files()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        return last
