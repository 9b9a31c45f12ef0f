"""Helpers for the server tests: an isolated node, client processes driven by commands, and
finding (and killing) the servers a test caused.

- `Node`: one pool directory on /dev/shm, one storage directory, and the environment every process
  of the test gets (a small pool, no user config file). It starts foreground servers, spawns
  agents, lists the live `hpkv.server.daemon` processes of its directory (by their environment),
  and kills whatever is left when the test ends.
- `Agent`: a real client process (this file run as a script). The test writes one JSON command
  per line to its stdin; the agent runs it with its own `hpkv.server.client.Client` and answers
  one JSON line: the result, or the error it got, always with the time the call took.

Entries are deterministic: `entry_key(prefix, i)` and `payload(key, rank, size)`, so any process
can check the bytes another one wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpkv.keys import NamespaceDesc, make_key
from hpkv.server import protocol as p

ENTRY_BYTES = 256 << 10
POOL_SIZE = "64m"


def desc(rank: int = 0, entry_bytes: int = ENTRY_BYTES, model: str = "tiny-llm") -> NamespaceDesc:
    return NamespaceDesc(engine="test", model=model, dtype="bfloat16", layout="blocks", block_size=16,
                         num_layers=4, entry_bytes=entry_bytes, tp_size=2, rank=rank)


def entry_key(prefix: str, i: int) -> bytes:
    return make_key(hashlib.sha256(f"{prefix}-{i}".encode()).digest())


def payload(key: bytes, rank: int = 0, size: int = ENTRY_BYTES) -> bytes:
    block = hashlib.blake2b(key + bytes([rank])).digest()
    return (block * (size // len(block) + 1))[:size]


# -- the test side -------------------------------------------------------------------------------

class Node:
    """One node's worth of HPKV directories and environment, and everything started for it."""

    def __init__(self, shm_dir: Path, work_dir: Path, **env: str) -> None:
        self.shm_dir = Path(shm_dir)
        self.work_dir = Path(work_dir)
        self.storage_dir = self.work_dir / "storage"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("HPKV_", "VLLM_HPKV"))}
        self.env.update({
            "HPKV_SHARE_MEM_FILE_PATH": str(self.shm_dir),
            "HPKV_KV_STORAGE_PATH": str(self.storage_dir),
            "HPKV_KV_MEM_POOL_SIZE": POOL_SIZE,
            "HPKV_CONFIG_FILE_PATH": str(self.work_dir / "no-such-config.ini"),
            "HPKV_SERVER_IDLE_EXIT_S": "30",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
        })
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

    def agent(self, kind: str = "worker", cwd: Path | None = None, **client_kw) -> "Agent":
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
        proc = subprocess.Popen([sys.executable, "-m", "hpkv.server.daemon"], env={**self.env, **env},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        self.servers.append(proc)
        deadline = time.monotonic() + timeout_s
        while not _answers(self.socket_path):
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
            if _alive(int(entry.name)):
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
            self.proc = subprocess.Popen([sys.executable, __file__, json.dumps({"kind": kind, **client_kw})],
                                         env=node.env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, bufsize=1)
        self.pid = self.proc.pid
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.recv(timeout_s=30)  # "ready": imports done

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, op: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

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
        self.proc.stdin.close()
        if self.proc.wait(timeout=30) != 0:
            raise AgentError(f"agent {self.pid} exited with {self.proc.returncode}; {self.diagnostics()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def diagnostics(self) -> str:
        err = self.stderr_path.read_text(errors="replace")[-1500:]
        return f"agent stderr: {err!r}; server log: {self.node.server_log()[-1500:]!r}"


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every one of its threads is stopped. The signal alone is not
    enough: the kernel stops the threads as each next runs, and on a busy machine one of them may
    still answer a request meanwhile."""
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


def wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} still alive after {timeout_s} s")
        time.sleep(0.02)


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s (last: {value!r})")
        time.sleep(interval_s)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


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


# -- the agent side ------------------------------------------------------------------------------

class _AgentLoop:
    def __init__(self, config: dict) -> None:
        from hpkv.server.client import Client

        self.client = Client(os.environ["HPKV_SHARE_MEM_FILE_PATH"], **config)
        self.ns: dict[tuple[int, int], str] = {}
        self.leases: list = []

    def run(self) -> None:
        print(json.dumps({"ready": os.getpid()}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            op = command.pop("op")
            started = time.monotonic()
            try:
                answer = getattr(self, "op_" + op)(**command)
            except Exception as exc:  # the test wants to see every error a client gets
                answer = {"error": type(exc).__name__, "code": getattr(exc, "code", None), "message": str(exc)}
            answer["elapsed_s"] = time.monotonic() - started
            answer["server_pid"] = self.client.server_pid
            print(json.dumps(answer), flush=True)
        self.client.close()

    def _ns(self, rank: int, entry_bytes: int) -> str:
        return self.ns[(rank, entry_bytes)]

    def op_register(self, rank: int = 0, entry_bytes: int = ENTRY_BYTES) -> dict:
        self.ns[(rank, entry_bytes)] = self.client.register(desc(rank, entry_bytes))
        return {"ns": self.ns[(rank, entry_bytes)]}

    def op_save(self, prefix: str, n: int, rank: int = 0, entry_bytes: int = ENTRY_BYTES, start: int = 0) -> dict:
        """Reserve, copy each payload into the pool through this process's mapping, commit."""
        ns = self._ns(rank, entry_bytes)
        keys = [entry_key(prefix, i) for i in range(start, start + n)]
        res = self.client.reserve(ns, keys)
        for i, key in enumerate(keys):
            if res.offsets[i] is not None:
                res.view(i)[:] = payload(key, rank, entry_bytes)
        return {"reserved": sum(o is not None for o in res.offsets), "committed": self.client.commit(ns, keys)}

    def op_reserve(self, prefix: str, n: int, rank: int = 0, entry_bytes: int = ENTRY_BYTES) -> dict:
        """Reserve and keep the reservations (no commit, no abort)."""
        res = self.client.reserve(self._ns(rank, entry_bytes), [entry_key(prefix, i) for i in range(n)])
        return {"reserved": sum(o is not None for o in res.offsets)}

    def op_lookup(self, prefix: str, n: int, rank: int = 0, entry_bytes: int = ENTRY_BYTES) -> dict:
        hit = self.client.lookup(self._ns(rank, entry_bytes), [entry_key(prefix, i) for i in range(n)])
        return {"tiers": [int(t) for t in hit.tiers]}

    def op_load(self, prefix: str, n: int, rank: int = 0, entry_bytes: int = ENTRY_BYTES,
                release: bool = True) -> dict:
        """Lease, wait for promotions, and check every ready entry against its payload."""
        keys = [entry_key(prefix, i) for i in range(n)]
        lease = self.client.lease(self._ns(rank, entry_bytes), keys)
        num_ready = self.client.wait(lease, timeout_s=10.0)
        same = [bytes(lease.view(i)) == payload(keys[i], rank, entry_bytes) for i in range(num_ready or 0)]
        if release:
            self.client.release(lease)
        else:
            self.leases.append(lease)
        return {"num_leased": len(lease.offsets), "num_ready": num_ready, "same": same}

    def op_stats(self) -> dict:
        import msgspec

        return {"stats": msgspec.to_builtins(self.client.stats())}

    def op_write_loop(self, prefix: str, seconds: float, rank: int = 0, entry_bytes: int = ENTRY_BYTES,
                      copy_pause_s: float = 0.002, until_commits_on_next_server: int = 0) -> dict:
        """Write entries one by one, copying each in two halves with a pause between (so a crash
        can find one half-copied), for `seconds` at most, or until that many entries were
        committed on a server other than the first. Records how every call went."""
        from hpkv.server.autostart import ServerUnavailable

        ns = self._ns(rank, entry_bytes)
        half = entry_bytes // 2
        out = {"max_call_s": 0.0, "unavailable": 0, "other_errors": [], "reserved_only": [], "commit_sent": [],
               "committed": [], "server_pids": []}

        def timed(fn, *args):
            started = time.monotonic()
            try:
                return fn(*args)
            finally:
                out["max_call_s"] = max(out["max_call_s"], time.monotonic() - started)

        def on_next_server() -> int:
            return sum(pid != out["server_pids"][0] for _, pid in out["committed"])

        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            if until_commits_on_next_server and out["committed"] and \
                    on_next_server() >= until_commits_on_next_server:
                break
            key, i = entry_key(prefix, i), i + 1
            try:
                res = timed(self.client.reserve, ns, [key])
                if res.offsets[0] is None:
                    continue
                data = payload(key, rank, entry_bytes)
                out["reserved_only"].append(i - 1)
                res.view(0)[:half] = data[:half]
                time.sleep(copy_pause_s)
                res.view(0)[half:] = data[half:]
                out["reserved_only"].pop()
                out["commit_sent"].append(i - 1)
                if timed(self.client.commit, ns, [key]) == 1:
                    out["committed"].append([i - 1, self.client.server_pid])
                    if self.client.server_pid not in out["server_pids"]:
                        out["server_pids"].append(self.client.server_pid)
            except ServerUnavailable:
                out["unavailable"] += 1
                time.sleep(0.01)
            except Exception as exc:
                out["other_errors"].append(f"{type(exc).__name__}: {exc}")
        out["num_keys"] = i
        return out


if __name__ == "__main__":
    _AgentLoop(json.loads(sys.argv[1])).run()
