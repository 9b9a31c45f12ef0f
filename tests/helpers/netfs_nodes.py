"""The parent's side of the network file system node tests: a node process (`helpers.netfs_node`)
in its own UTS namespace with its own host name, driven one JSON command at a time, and `poll`
for what another mount shows late."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from helpers.waiting import wait_for

BIG = 1 << 30


class NodeProcess:
    """A node: `helpers.netfs_node` in its own UTS namespace, host name `host`."""

    def __init__(
        self, host: str, root: Path, capacity_bytes: int = BIG, cluster: str = "off", lease_s: float = 30.0
    ) -> None:
        """`cluster`, `lease_s`: HPKV_KV_STORAGE_CLUSTER and HPKV_KV_STORAGE_LEASE of its tier."""
        self.host = host
        command = ["helpers.netfs_node", host, str(root), str(capacity_bytes), cluster, str(lease_s)]
        self.proc = subprocess.Popen(
            ["unshare", "--uts", sys.executable, "-m", *command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            cwd=Path(__file__).parents[1],
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        assert self._recv(60) == {"ready": host}

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put({"error": f"node {self.host} exited with {self.proc.wait()}"})

    def _recv(self, timeout_s: float) -> dict:
        return self._lines.get(timeout=timeout_s)

    def __call__(self, op: str, timeout_s: float = 120.0, **args) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        answer = self._recv(timeout_s)
        assert "error" not in answer, f"node {self.host} {op}: {answer['error']}"
        return answer

    def kill(self) -> None:
        """kill -9: no lease removed, nothing finished."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def poll(node: NodeProcess, what: str, done, timeout_s: float = 15.0, **args) -> dict:
    """`node(what, **args)` again until `done(answer)` (the file system shows it), or fail."""

    def answer() -> dict | None:
        got = node(what, **args)
        return got if done(got) else None

    return wait_for(answer, timeout_s, 0.1, what=f"{what} {args}")
