"""SGLang end to end: time to first token with HPKV as HiCache's L3, next to SGLang's built-in
`file` L3 backend, on the same SGLang, model and steps.

    python -m bench.sglang_ttft [--prompt-words 2000 8000] [--repeats 3] [--workdir DIR] [--json]

Runs from the repository (it needs `.venv-sglang`, `make setup`, and on a CPU the test-only
layer tests/sglang_cpu/). A random Qwen2 with `hpkv.demo.model.BENCH`'s 8 KiB of KV per token
(each hit moves as many bytes) but a quarter of its attention (`SHAPE`: SGLang's `torch_native`
backend computes a hit's few new tokens as a causal attention over the whole prompt,
`per_req_query_redudant`), built under `--workdir` and kept for the next run, is served by a
real `sglang serve` with SGLang's CPU flags, the same host layout and io backend
(`page_first_direct`, `direct`), page size 64 and prefetch policy `wait_complete`, once with
`--enable-ct-hpkv` and once with `--enable-hierarchical-cache --hicache-storage-backend file`.
Two engine starts per backend; for each prompt length, in one run:

- cold: a prompt the engine has never seen (computed, then backed up to L3);
- device hit: the same prompt again (SGLang's own prefix cache; the reference output);
- L3 after /flush_cache (SGLang's device and host caches emptied): HPKV's DRAM pool / the files;
- L3 after a restart (for HPKV once its auto-started server has exited: its storage tier) / the files.

The device and /flush_cache steps are the median of `--repeats`; cold and restart are one
request each (a second would not be cold). Each engine first serves one untimed prompt just
above the L3 threshold, so that no row pays for a first lookup. Every hit must give the device
hit's tokens and logprobs and come from L3 (`meta_info.cached_tokens_details`). The target
(HPKV's storage hit no slower than the `file` backend's hit after a restart) is printed with
PASS/MISS, never asserted. The files of both backends are in the OS page cache: neither pays a
disk read. SIGINT, SIGTERM or an error stop the engines and HPKV's server before it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.engine import wait_for_hpkv_server_exit
from bench.harness.report import log, verdict
from hpkv.demo.model import ModelShape, build_model, prompt_text
from hpkv.demo.sglang_engine import SglangCompletion, SglangServer
from hpkv.server.client import Client

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv-sglang" / "bin" / "python"
COMPAT = REPO / "tests" / "sglang_cpu"
COMMON = ("--hicache-mem-layout", "page_first_direct", "--hicache-io-backend", "direct")
COMMON += ("--hicache-storage-prefetch-policy", "wait_complete")
FILE_L3 = ("--enable-hierarchical-cache", "--hicache-storage-backend", "file")
STEPS = {"cold": "cold", "device": "device hit", "flush": "L3 after /flush_cache", "restart": "L3 after restart"}
WARM_WORDS = 1300  # just above the 1204-token L3 threshold: one cheap first lookup per engine
PAGE = 64
SHAPE = ModelShape(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=8, intermediate_size=1024)


class Backend:
    """One backend's two engine starts on its own directories, and its rows."""

    def __init__(self, name: str, model: Path, work: Path, repeats: int) -> None:
        self.name, self.model, self.work, self.repeats = name, model, work, repeats
        self.pool = Path(tempfile.mkdtemp(prefix="hpkv-bench-", dir="/dev/shm"))
        self.env = {
            "PYTHONPATH": f"{COMPAT}:{REPO / 'src'}",
            "HF_HUB_OFFLINE": "1",
            "HPKV_KV_MEM_POOL_SIZE": "1g",
            "HPKV_SHARE_MEM_FILE_PATH": str(self.pool),
            "HPKV_KV_STORAGE_PATH": str(work / f"{name}-storage"),
            "HPKV_CONFIG_FILE_PATH": str(work / "no-config.ini"),
            "HPKV_SERVER_IDLE_EXIT_S": "2",
            "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(work / "file-storage"),
        }
        self.ttft_ms: dict[int, dict[str, float]] = {}
        self.seconds: dict[str, float] = {}  # where the run's time went
        self.right = True

    def engine(self, phase: str) -> SglangServer:
        extra = COMMON if self.name == "hpkv" else COMMON + FILE_L3
        return SglangServer(
            str(self.model),
            self.env,
            hpkv=self.name == "hpkv",
            launcher="serve",
            extra_flags=extra,
            python=str(PYTHON),
            log_path=self.work / f"sglang-{self.name}-{phase}.log",
        )

    def timed(self, what: str, fn, *args):
        started = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.seconds[what] = self.seconds.get(what, 0.0) + time.monotonic() - started
            log(f"{self.name}: {what} {time.monotonic() - started:.1f} s")

    def run(self, texts: dict[int, str]) -> None:
        refs: dict[int, SglangCompletion] = {}
        for phase in ("first", "restart"):
            engine = self.engine(phase)
            try:
                self.timed(f"{phase} start", engine.start)
                self.timed(f"{phase} warm-up", warm_up, engine, WARM_WORDS, 7 if phase == "first" else 8)
                for n, text in texts.items():
                    if phase == "first":
                        refs[n] = self.timed(f"{n} words: cold, device, flush", self.first_steps, engine, n, text)
                    else:
                        self.ttft_ms[n]["restart"] = self.timed(f"{n} words: restart", self.hit, engine, text, refs[n])
            finally:
                self.timed(f"{phase} stop", engine.stop, 15.0)
            self.timed(f"{phase}: HPKV server exit", stop_hpkv_server, self.pool)

    def first_steps(self, engine: SglangServer, n: int, text: str) -> SglangCompletion:
        backed = engine.backed_up_tokens()
        row = self.ttft_ms.setdefault(n, {})
        cold = ttft(engine, text)
        row["cold"] = cold.ttft_s * 1e3
        devices = [ttft(engine, text) for _ in range(self.repeats)]
        row["device"] = statistics.median(d.ttft_s for d in devices) * 1e3
        wait_backed_up(engine, backed + cold.prompt_tokens // PAGE * PAGE)
        hits = []
        for _ in range(self.repeats):
            engine.flush_cache()
            hits.append(self.hit(engine, text, devices[0]))
        row["flush"] = statistics.median(hits)
        return devices[0]

    def hit(self, engine: SglangServer, text: str, reference: SglangCompletion) -> float:
        hit = ttft(engine, text)
        right = hit.token_ids == reference.token_ids and hit.logprobs == reference.logprobs
        if not right or not hit.cached.get("storage"):
            log(f"{self.name}: not an identical L3 hit: {hit.cached}, identical={right}")
            self.right = False
        return hit.ttft_s * 1e3

    def close(self) -> None:
        try:
            stop_hpkv_server(self.pool)
        finally:
            shutil.rmtree(self.pool, ignore_errors=True)


def warm_up(engine: SglangServer, words: int, seed: int) -> None:
    engine.complete("warm up", max_tokens=1)
    engine.complete(prompt_text(words, seed=seed), max_tokens=1)


def ttft(engine: SglangServer, text: str) -> SglangCompletion:
    engine.complete("warm up", max_tokens=1)  # no row pays for an idle engine's first request
    return engine.complete(text)


def wait_backed_up(engine: SglangServer, tokens: float, timeout_s: float = 60.0) -> None:
    """Pages reach L3 after the response; a restart before then would find fewer."""
    deadline = time.monotonic() + timeout_s
    while engine.backed_up_tokens() < tokens:
        if time.monotonic() > deadline:
            log(f"only {engine.backed_up_tokens():.0f} of {tokens:.0f} tokens backed up after {timeout_s:.0f} s")
            return
        time.sleep(0.2)


def stop_hpkv_server(pool: Path) -> None:
    """HPKV's auto-started server exits 2 s after the engine's clients have gone (then its DRAM
    tier goes with it); one that does not is stopped by its pid."""
    try:
        wait_for_hpkv_server_exit(pool, timeout_s=20.0)
        return
    except TimeoutError:
        pass
    with Client(pool, kind="bench", autostart=False) as client:
        pid = client.stats().server.pid
    log(f"HPKV server {pid} still up: SIGTERM")
    os.kill(pid, signal.SIGTERM)
    wait_for_hpkv_server_exit(pool, timeout_s=30.0)


def _raise_exit(signum: int, frame) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # one clean-up: a second signal waits for it
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def measure(args: argparse.Namespace, model: Path, work: Path) -> dict[str, Backend]:
    texts = {n: prompt_text(n, seed=100 + n) for n in args.prompt_words}
    backends: dict[str, Backend] = {}
    try:
        for name in ("hpkv", "file"):
            backends[name] = Backend(name, model, work, args.repeats)
            backends[name].run(texts)
    finally:
        for backend in backends.values():
            backend.close()
    return backends


def report(backends: dict[str, Backend], words: list[int]) -> None:
    h, f = backends["hpkv"], backends["file"]
    print(f"{'prompt':>7} {'step':<22} {'HPKV ms':>9} {'file ms':>9}")
    for n in words:
        for step, name in STEPS.items():
            print(f"{n:>7} {name:<22} {h.ttft_ms[n][step]:>9.0f} {f.ttft_ms[n][step]:>9.0f}")
        ratio = h.ttft_ms[n]["restart"] / f.ttft_ms[n]["restart"]
        print(f"{n:>7} HPKV storage / file after restart: {ratio:.2f} (target <= 1.00: {verdict(ratio <= 1.0)})")
    print(f"every hit identical and from L3: {h.right and f.right}")
    for b in (h, f):
        print(f"{b.name} seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in b.seconds.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-words", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "hpkv-sglang-bench")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not PYTHON.exists():
        print(f"{PYTHON} is missing: run `make setup`", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_exit)
    started = time.monotonic()
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=args.workdir))
    model = build_model(args.workdir / "qwen2-4x512", SHAPE)
    backends = measure(args, model, work)
    if args.json:
        print(
            json.dumps(
                {b.name: {"ttft_ms": b.ttft_ms, "right": b.right, "seconds": b.seconds} for b in backends.values()}
            )
        )
    else:
        report(backends, args.prompt_words)
    print(f"{time.monotonic() - started:.0f} s; logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
