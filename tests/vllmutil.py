"""Helpers for the end-to-end tests on a real vLLM: engines with their counters, the node's HPKV
server, KV files on storage, and the oracle (a hit must give exactly what vLLM's own hit gives).

An `Engine` is the demo's `VllmServer` (started exactly as the documentation says) plus what a
test needs to read a story off it: how many tokens each request took from each cache tier, once
vLLM's metrics have caught up with the requests sent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import serverutil
from hpkv.benchmark.shim import after_import, install
from hpkv.demo.engine import Completion, VllmServer
from hpkv.errors import HpkvError
from hpkv.server import protocol
from hpkv.server.autostart import answers
from hpkv.server.client import Client
from hpkv.stats import ServerStats

BLOCK_SIZE = 32
# Every variable that configures HPKV; the tests build each engine's environment from nothing.
HPKV_ENV_PREFIXES = ("HPKV_", "VLLM_HPKV_", "VLLM_ENABLE_HPKV")
_COUNTER_PREFIX = {
    "source": "vllm:prompt_tokens_cached_by_source_total{",
    "hpkv": "vllm:hpkv_",
    "finished": "vllm:request_success_total{",
}


def wait_for(predicate, timeout_s: float = 60.0, interval_s: float = 0.1, what: str = "condition"):
    """serverutil.wait_for with an engine-sized default timeout."""
    return serverutil.wait_for(predicate, timeout_s=timeout_s, interval_s=interval_s, what=what)


def same_output(a: Completion, b: Completion) -> bool:
    """The oracle: identical token ids and bit-identical logprobs."""
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs and len(a.logprobs) > 0


# -- engines --------------------------------------------------------------------------------


@dataclass
class Counters:
    """Cumulative prompt tokens by cache source ('device', 'host', 'disk') and HPKV counters
    ('skipped_tokens', 'hit_tokens_dram', ...) of one engine."""

    values: dict[str, float]

    def __getitem__(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def __sub__(self, other: "Counters") -> "Counters":
        names = set(self.values) | set(other.values)
        return Counters({n: self[n] - other[n] for n in names})


class Engine:
    def __init__(self, name: str, model: Path, env: dict[str, str], log_dir: Path, **options) -> None:
        self.name = name
        self.log_path = log_dir / f"vllm-{name}.log"
        self.server = VllmServer(str(model), env, log_path=self.log_path, **options)
        self._lock = threading.Lock()
        self._num_requests = 0
        self._references: dict[object, Completion] = {}

    def start(self) -> "Engine":
        try:
            self.server.start(timeout_s=600)
        except Exception as exc:
            raise RuntimeError(f"engine {self.name}: {exc}\n{self.log_tail()}") from None
        return self

    def stop(self) -> None:
        self.server.stop()
        process = self.server.process
        if process is not None:
            try:  # the engine core may outlive an API server that died at start
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    # -- requests ---------------------------------------------------------------------------

    def complete(self, prompt: str | list[int], max_tokens: int = 16) -> Completion:
        with self._lock:
            self._num_requests += 1
        return self.server.complete(prompt, max_tokens)

    def reference(self, prompt: str | list[int], max_tokens: int = 16) -> Completion:
        """vLLM's own prefix-cache hit: the prompt sent twice, the second answer (memoized). Take
        it on an engine without HPKV: on one with HPKV, a second send after a load reuses the
        loaded blocks, so a bad load would agree with itself."""
        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens)
        if key not in self._references:
            self.complete(prompt, max_tokens)
            self._references[key] = self.complete(prompt, max_tokens)
        return self._references[key]

    def tokenize(self, text: str) -> list[int]:
        return self.server.post("/tokenize", {"model": self.server.served_name, "prompt": text})["tokens"]

    def reset_prefix_cache(self, external: bool = False) -> None:
        # vLLM refuses while blocks of finishing requests are still held: try again briefly.
        wait_for(lambda: self.server.reset_prefix_cache(external), timeout_s=30,
                 what=f"{self.name}: /reset_prefix_cache (reset_external={external}) to succeed")

    # -- counters ---------------------------------------------------------------------------

    def counters(self) -> Counters:
        """The counters once vLLM's metrics include every request sent so far (the stats of a
        request reach /metrics a little after its last token reaches the client)."""
        with self._lock:
            expected = self._num_requests
        snapshot = {}

        def caught_up() -> bool:
            snapshot.clear()
            snapshot.update(self._read_counters())
            return snapshot["finished"] >= expected

        wait_for(caught_up, timeout_s=60, what=f"{self.name}: metrics of {expected} requests")
        return Counters(dict(snapshot))

    def _read_counters(self) -> dict[str, float]:
        out = {"finished": 0.0}
        for name, value in self.server.metrics().items():
            if name.startswith(_COUNTER_PREFIX["source"]):
                source = name.split('source="')[1].split('"')[0]
                out[source] = out.get(source, 0.0) + value
            elif name.startswith(_COUNTER_PREFIX["hpkv"]):
                counter = name[len(_COUNTER_PREFIX["hpkv"]):].split("{")[0].removesuffix("_total")
                out[counter] = out.get(counter, 0.0) + value
            elif name.startswith(_COUNTER_PREFIX["finished"]):
                out["finished"] += value
        return out


def start_all(engines: list[Engine], gate=None) -> None:
    """Start engines side by side (a start mostly waits, so two overlap well on two cores). With
    `gate`, the first starts alone until gate() is true (or its start has ended)."""
    errors: list[BaseException] = []

    def start(engine: Engine) -> None:
        try:
            engine.start()
        except BaseException as exc:  # reported below, after every start has ended
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(e,)) for e in engines]
    threads[0].start()
    if gate is not None:
        wait_for(lambda: gate() or not threads[0].is_alive(), timeout_s=600, interval_s=0.5,
                 what=f"{engines[0].name} to get far enough in its start")
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


# -- the node's HPKV server -----------------------------------------------------------------


def server_stats(shm_dir: Path) -> ServerStats | None:
    """The running server's stats, or None when none answers. Never starts one."""
    if not answers(shm_dir / protocol.SOCKET_NAME):
        return None
    try:
        with Client(shm_dir, kind="test", autostart=False) as client:
            return client.stats()
    except HpkvError:
        return None


def server_pid(shm_dir: Path) -> int | None:
    stats = server_stats(shm_dir)
    return stats.server.pid if stats else None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    wait_for(lambda: not alive(pid), timeout_s, what=f"HPKV server {pid} to exit")


def kill_server(pid: int | None) -> None:
    if pid is not None and alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- storage --------------------------------------------------------------------------------


def kv_files(storage_dir: Path) -> set[Path]:
    return set(Path(storage_dir).rglob("*.kv"))


def settled_files(storage_dir: Path, at_least: int = 0, timeout_s: float = 60.0) -> set[Path]:
    """The KV files once the server's write-throughs have landed: at least `at_least` of them,
    no temporary in flight, and the same set on three polls in a row."""
    seen: list[set[Path]] = []

    def settled() -> tuple[set[Path]] | None:
        files = kv_files(storage_dir)
        in_flight = any(Path(storage_dir).rglob("*.tmp"))
        seen.append(files)
        if len(files) >= at_least and not in_flight and len(seen) >= 3 and seen[-3] == seen[-2] == files:
            return (files,)  # a tuple: an empty set is an answer too
        return None

    return wait_for(settled, timeout_s, interval_s=0.2, what=f"{at_least} KV files under {storage_dir}")[0]


def num_saved_blocks(completion: Completion) -> int:
    """Full blocks a request computed: its prompt and all generated tokens but the last."""
    return (completion.prompt_tokens + len(completion.token_ids or []) - 1) // BLOCK_SIZE


def flip_middle_bytes(path: Path, num_bytes: int = 16) -> bytes:
    """Corrupt a file in place (same inode, same size); returns the corrupted content."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + num_bytes, len(data))):
        data[i] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(data)
    return bytes(data)


@contextlib.contextmanager
def serving(engine: Engine, shm_dir: Path, env_prefixes: tuple[str, ...] = HPKV_ENV_PREFIXES):
    """Start `engine` without this process's own HPKV settings (an engine gets only those it was
    given); on the way out stop it and the HPKV server it auto-started in `shm_dir`."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith(env_prefixes)}
    try:
        engine.start()
        yield engine
    finally:
        pid = server_pid(shm_dir)
        engine.stop()
        kill_server(pid)
        os.environ.update(saved)


# A load that fails inside the engine (its lease lost between the scheduler's and the worker's,
# say), on demand: once `flag` exists, the worker's next load zeroes the blocks it was loading
# into (a copy torn by the failure) and reports them all failed, and `flag` is removed. The real
# engine, server and connector otherwise; inert while `flag` does not exist.
_LOAD_FAULT = """
import os
load = module.HpkvWorker._load
def failing_load(self, job, _load=load, _flag={flag!r}):
    try:
        os.unlink(_flag)
    except FileNotFoundError:
        return _load(self, job)
    for view in self.copier.layer_views:
        view[job.block_ids] = 0
    return 0
module.HpkvWorker._load = failing_load
"""


def with_load_fault(env: dict[str, str], shim_dir: Path, flag: Path) -> dict[str, str]:
    """`env` for an engine whose next load fails once `flag` exists (see _LOAD_FAULT)."""
    code = after_import("hpkv.integrations.vllm.worker", _LOAD_FAULT.format(flag=str(flag)))
    return install(env, shim_dir, code)
