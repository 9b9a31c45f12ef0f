"""vLLM engines as the benchmarks drive them: the demo's `VllmServer` (started exactly as the
documentation says) plus what a benchmark reads off it. Primitives: `Engine` (start, complete,
`measure` -> (Completion, Sample), per-source `counters`, `warm_up`), `start_together`,
`engine_env`, `engine_shim` (code run inside the engine's processes), `compare` (a hit against the
in-engine hit), and the HPKV server's life seen from outside (`hpkv_server_alive`,
`wait_for_hpkv_server_exit`). Must not know any one benchmark's rows or targets.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bench.harness.shim import after_import, install
from hpkv.demo.engine import Completion, VllmServer
from hpkv.demo.model import prompt_text
from hpkv.pool.region import POOL_FILE_NAME

from .report import log

WAKE_PROMPT = prompt_text(8, seed=-7)

# vLLM's shared-memory message queues keep a reader spinning on sched_yield for 1 s after each
# message (`SpinCondition`, busy_loop_s=1), which on a small CPU slows a forward pass but without
# which its fast mode was slower. The benchmarks keep vLLM's default; HPKV_BENCH_VLLM_SPIN=0
# starts every engine, of every system alike, with busy_loop_s=0 (a reader waits for the queue's
# zmq notification), through this sitecustomize on its PYTHONPATH.
NO_SPIN = after_import(
    "vllm.distributed.device_communicators.shm_broadcast",
    "module.SpinCondition.__init__.__defaults__ = (0.0,)  # busy_loop_s",
)


def engine_shim(env: dict[str, str], shim_dir: Path, code: str | None = None) -> dict[str, str]:
    """`env` with a sitecustomize first on the engine's PYTHONPATH: NO_SPIN (with
    HPKV_BENCH_VLLM_SPIN=0), then `code`."""
    code = "\n".join(filter(None, [NO_SPIN if os.environ.get("HPKV_BENCH_VLLM_SPIN") == "0" else None, code]))
    return install(env, shim_dir, code) if code else env


@dataclass
class Sample:
    ttft_s: float
    prompt_tokens: int
    sources: dict[str, float]  # cached prompt tokens by source: device / host / disk
    same_ids: bool | None = None  # token ids equal to the in-engine hit's (hits only)
    same_logprobs: bool | None = None


def compare(sample: Sample, completion: Completion, reference: Completion) -> Sample:
    sample.same_ids = completion.token_ids == reference.token_ids and bool(reference.token_ids)
    sample.same_logprobs = completion.logprobs == reference.logprobs
    return sample


def engine_env() -> dict[str, str]:
    # engine.py sets the CPU engine's KV space to 1 GiB over os.environ; honour an explicit one.
    keep = ("VLLM_CPU_KVCACHE_SPACE",)
    return {name: os.environ[name] for name in keep if name in os.environ}


class Engine:
    """A VllmServer plus what the benchmark reads from it: per-source cached tokens, counted once
    vLLM's metrics include every request sent (they lag the last streamed token a little)."""

    def __init__(
        self,
        name: str,
        model: str,
        env: dict[str, str],
        hpkv: bool,
        log_dir: Path,
        extra_flags: tuple[str, ...] = (),
        shim: str | None = None,
        start_timeout_s: float = 600,
    ) -> None:
        self.name = name
        self.start_timeout_s = start_timeout_s  # a first start compiles: long for a wide model on 2 cores
        self.env = env = engine_shim(env, log_dir / f"shim-{name}", shim)
        self.server = VllmServer(model, env, hpkv=hpkv, log_path=log_dir / f"vllm-{name}.log", extra_flags=extra_flags)
        self._lock = threading.Lock()
        self._num_sent = 0

    def start(self) -> Engine:
        started = time.monotonic()
        self.server.start(timeout_s=self.start_timeout_s)
        log(f"{self.name}: up in {time.monotonic() - started:.0f} s (log {self.server.log_path})")
        return self

    def stop(self) -> None:
        self.server.stop()

    def complete(self, prompt: str, max_tokens: int) -> Completion:
        with self._lock:
            self._num_sent += 1
        return self.server.complete(prompt, max_tokens)

    def counters(self, timeout_s: float = 30.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            out = {"finished": 0.0}
            for name, value in self.server.metrics().items():
                if name.startswith("vllm:prompt_tokens_cached_by_source_total{"):
                    source = name.split('source="')[1].split('"')[0]
                    out[source] = out.get(source, 0.0) + value
                elif name.startswith("vllm:hpkv_"):
                    counter = name[len("vllm:hpkv_") :].split("{")[0].removesuffix("_total")
                    out["hpkv_" + counter] = out.get("hpkv_" + counter, 0.0) + value
                elif name.startswith("vllm:request_success_total{"):
                    out["finished"] += value
            if out["finished"] >= self._num_sent or time.monotonic() > deadline:
                return out
            time.sleep(0.05)

    def measure(self, prompt: str, max_tokens: int) -> tuple[Completion, Sample]:
        """One timed request, right after an untimed tiny one: a request after an idle second has
        a TTFT hundreds of ms longer on a CPU engine, so every timed request starts from the same
        just-served state. Returns the completion and its Sample (cached tokens by source)."""
        before = self.counters()
        self.complete(WAKE_PROMPT, 1)  # shorter than a block: no cache hit, no HPKV lookup or save
        completion = self.complete(prompt, max_tokens)
        after = self.counters()
        sources = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("device", "host", "disk")}
        return completion, Sample(completion.ttft_s, completion.prompt_tokens, sources)

    def reset_prefix_cache(self) -> None:
        # vLLM refuses while a finishing request still holds blocks: try again briefly.
        deadline = time.monotonic() + 10
        while not self.server.reset_prefix_cache() and time.monotonic() < deadline:
            time.sleep(0.1)

    def warm_up(self, prompt: str, concurrency: int = 4) -> None:
        """Every path timed later, taken once untimed with `prompt` (a long prompt of the
        warm-up's own), since an engine's first request down a path pays one-time costs:
        computed (on a restarted engine, a storage hit), an in-engine hit, on an HPKV engine a
        DRAM hit, then one batch of `concurrency` short prompts."""
        self.complete(prompt, 2)
        self.complete(prompt, 2)
        if self.server.hpkv:
            self.reset_prefix_cache()
            self.complete(prompt, 2)
        self.send_concurrently([prompt_text(256, seed=-2000 - i) for i in range(concurrency)], concurrency, 4)

    def send_concurrently(self, prompts: list[str], concurrency: int, max_tokens: int) -> float:
        started = time.perf_counter()
        self.send_all(prompts, concurrency, max_tokens)
        return time.perf_counter() - started

    def send_all(self, prompts: list[str], concurrency: int, max_tokens: int) -> list[Completion]:
        """Every prompt, `concurrency` at a time; the completions in the prompts' order."""
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens), prompts))


class _Startable(Protocol):
    def start(self) -> object: ...


def start_together(engines: Sequence[_Startable]) -> None:
    """Engine starts (anything with `start()`) mostly wait (imports, loading), so two overlap
    well even on two cores."""
    errors: list[BaseException] = []

    def start(engine: _Startable) -> None:
        try:
            engine.start()
        except BaseException as exc:  # reported below, once every start has ended
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(e,)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def wait_for_hpkv_server_exit(pool_dir: Path, timeout_s: float = 120.0) -> float:
    """The auto-started server exits HPKV_SERVER_IDLE_EXIT_S after its last client has gone; until
    then its DRAM tier still holds every entry. Watched without connecting: a probe connection
    is a client too, and probing every half second would keep the server alive for ever."""
    started = time.monotonic()
    while hpkv_server_alive(pool_dir):
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"the HPKV server in {pool_dir} did not exit within {timeout_s:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - started


def hpkv_server_alive(pool_dir: Path) -> bool:
    """The server holds an exclusive flock on its pool file for its whole life (pool/region.py)."""
    try:
        fd = os.open(pool_dir / POOL_FILE_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it the shared lock, if it was taken
