"""A node for the server tests: one pool directory on /dev/shm, one storage directory, and the
environment every process of the test gets (a small pool, no user config file); the foreground
servers and client processes (`Agent`) it starts, the live `hpkv.server.daemon` processes of its
directory (found by their environment), killed when the test ends; and the raw protocol, for
tests that speak to the socket themselves.

An `Agent` is a real client process (`helpers.agent`): the test writes one JSON command per line
to its stdin and reads one JSON answer per line.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers.env import pythonpath, without_hpkv
from helpers.processes import alive, kill
from hpkv.errors import HpkvError
from hpkv.server import protocol as p
from hpkv.server.autostart import answers
from hpkv.stats import ServerStats

POOL_SIZE = "64m"


class Node:
    """One node's worth of HPKV directories and environment, and everything started for it."""

    def __init__(self, shm_dir: Path, work_dir: Path, **env: str) -> None:
        self.shm_dir = Path(shm_dir)
        self.work_dir = Path(work_dir)
        self.storage_dir = self.work_dir / "storage"
        self.env = without_hpkv()
        self.env.update(
            {
                "HPKV_SHARE_MEM_FILE_PATH": str(self.shm_dir),
                "HPKV_KV_STORAGE_PATH": str(self.storage_dir),
                "HPKV_KV_MEM_POOL_SIZE": POOL_SIZE,
                "HPKV_CONFIG_FILE_PATH": str(self.work_dir / "no-such-config.ini"),
                "HPKV_SERVER_IDLE_EXIT_S": "30",
                "PYTHONPATH": pythonpath(),
            }
        )
        self.env.update(env)
        self.agents: list[Agent] = []
        self.servers: list[subprocess.Popen] = []
        self.clients: list = []

    @property
    def socket_path(self) -> Path:
        return self.shm_dir / p.SOCKET_NAME

    @property
    def pool_path(self) -> Path:
        return self.shm_dir / "hpkv.pool"

    @property
    def log_path(self) -> Path:
        return self.shm_dir / "server.log"

    def server_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def agent(self, kind: str = "worker", cwd: Path | None = None, **client_kw) -> Agent:
        agent = Agent(self, kind, client_kw, cwd)
        self.agents.append(agent)
        return agent

    def client(self, kind: str = "test", **client_kw):
        """A client in this process; never auto-starts (this process lacks the node's environment)."""
        from hpkv.server.client import Client

        client = Client(self.shm_dir, kind, autostart=False, **client_kw)
        self.clients.append(client)
        return client

    def start_server(self, timeout_s: float = 20.0, **env: str) -> subprocess.Popen:
        """A foreground server (`python -m hpkv.server.daemon`), returned once it answers."""
        log = open(self.work_dir / f"server-{len(self.servers)}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpkv.server.daemon"],
            env={**self.env, **env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()
        self.servers.append(proc)
        deadline = time.monotonic() + timeout_s
        while not answers(self.socket_path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server did not start (rc {proc.poll()}): {self.foreground_log(proc)}")
            time.sleep(0.02)
        return proc

    def foreground_log(self, proc: subprocess.Popen) -> str:
        i = self.servers.index(proc)
        return (self.work_dir / f"server-{i}.log").read_text(errors="replace")

    def server_pids(self) -> list[int]:
        """Live `hpkv.server.daemon` processes serving this node's directory."""
        wanted = os.fsencode(f"HPKV_SHARE_MEM_FILE_PATH={self.shm_dir}")  # the name need not be UTF-8
        pids = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if b"hpkv.server.daemon" not in f.read():
                        continue
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if wanted not in f.read().split(b"\0"):
                        continue
            except OSError:
                continue
            if alive(int(entry.name)):
                pids.append(int(entry.name))
        return sorted(pids)

    def wait_no_server(self, timeout_s: float) -> float:
        """Seconds until no server of this node is left; AssertionError after `timeout_s`."""
        started = time.monotonic()
        while self.server_pids():
            if time.monotonic() - started > timeout_s:
                raise AssertionError(f"server still running after {timeout_s} s: {self.server_log()[-2000:]}")
            time.sleep(0.05)
        return time.monotonic() - started

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for agent in self.agents:
            agent.kill()
        for proc in self.servers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for pid in self.server_pids():
            kill(pid)
        deadline = time.monotonic() + 10
        while self.server_pids() and time.monotonic() < deadline:
            time.sleep(0.05)


class AgentError(AssertionError):
    pass


class Agent:
    """A client process running `hpkv.server.client.Client` calls on command."""

    def __init__(self, node: Node, kind: str, client_kw: dict, cwd: Path | None = None) -> None:
        self.node = node
        self.stderr_path = node.work_dir / f"agent-{kind}-{len(node.agents)}.err"
        with open(self.stderr_path, "wb") as err:
            config = json.dumps({"kind": kind, **client_kw})
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "helpers.agent", config],
                env=node.env,
                cwd=cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                bufsize=1,
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self.pid = self.proc.pid
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.recv(timeout_s=30)  # "ready": imports done

    def _read(self) -> None:
        for line in self._stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, op: str, **args) -> None:
        self._stdin.write(json.dumps({"op": op, **args}) + "\n")
        self._stdin.flush()

    def recv(self, timeout_s: float = 30.0) -> dict:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AgentError(f"agent {self.pid} gave no answer in {timeout_s} s; {self.diagnostics()}") from None
        if line is None:
            raise AgentError(f"agent {self.pid} exited (rc {self.proc.wait()}); {self.diagnostics()}")
        return json.loads(line)

    def try_call(self, op: str, timeout_s: float = 30.0, **args) -> dict:
        """The agent's answer, which may be an error (`answer["error"]` names its type)."""
        self.send(op, **args)
        return self.recv(timeout_s)

    def call(self, op: str, timeout_s: float = 30.0, **args) -> dict:
        answer = self.try_call(op, timeout_s, **args)
        if "error" in answer:
            raise AgentError(f"agent {self.pid} {op}: {answer}; {self.diagnostics()}")
        return answer

    def exit(self) -> None:
        """Close the client and end the process the ordinary way."""
        self._stdin.close()
        if self.proc.wait(timeout=30) != 0:
            raise AgentError(f"agent {self.pid} exited with {self.proc.returncode}; {self.diagnostics()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def diagnostics(self) -> str:
        err = self.stderr_path.read_text(errors="replace")[-1500:]
        return f"agent stderr: {err!r}; server log: {self.node.server_log()[-1500:]!r}"


# -- raw protocol, for tests that speak to the socket themselves ---------------------------------


def raw_connect(node: Node, hello: bool = True, timeout_s: float = 5.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(str(node.socket_path))
    if hello:
        sock.sendall(p.encode(p.Hello(p.PROTOCOL_VERSION, "raw", os.getpid())))
        welcome = p.decode_reply(p.recv_frame(sock))
        assert isinstance(welcome, p.Welcome), welcome
    return sock


def read_replies(sock: socket.socket) -> list[p.Reply]:
    """Every reply frame until the server closes the connection (socket.timeout if it never does)."""
    replies = []
    while True:
        try:
            replies.append(p.decode_reply(p.recv_frame(sock)))
        except (EOFError, ConnectionResetError):
            return replies


# -- a node's running server, by its directory -------------------------------------------------


def server_stats(shm_dir: Path) -> ServerStats | None:
    """The running server's stats, or None when none answers. Never starts one."""
    from hpkv.server.client import Client

    if not answers(shm_dir / p.SOCKET_NAME):
        return None
    try:
        with Client(shm_dir, kind="test", autostart=False) as client:
            return client.stats()
    except HpkvError:
        return None


def server_pid(shm_dir: Path) -> int | None:
    stats = server_stats(shm_dir)
    return stats.server.pid if stats else None


def kill_server(pid: int | None) -> None:
    if pid is not None and alive(pid):
        kill(pid)
