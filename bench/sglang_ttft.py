"""SGLang end to end: time to first token with HPKV as HiCache's L3, next to SGLang's built-in
`file` L3 backend, on the same SGLang, model and steps.

    python -m bench.sglang_ttft [--prompt-words 2000 8000] [--json]

Runs from the repository (it needs `.venv-sglang`, `make setup`, and on a CPU the test-only
layer tests/sglang_cpu/). One prefill-heavy random Qwen2 (`hpkv.demo.model.BENCH`) is served by
a real `sglang serve` with SGLang's CPU flags, the same host layout and io backend
(`page_first_direct`, `direct`), page size 64 and prefetch policy `wait_complete`, once with
`--enable-ct-hpkv` and once with `--enable-hierarchical-cache --hicache-storage-backend file`.
For each prompt length, on each backend, in one run:

- cold: a prompt the engine has never seen (computed, then backed up to L3);
- device hit: the same prompt again (SGLang's own prefix cache, the reference output);
- L3 after /flush_cache (SGLang's device and host caches emptied): HPKV's DRAM pool / the files;
- L3 after a restart (for HPKV once its auto-started server has exited: its storage tier) / the files.

After each start one untimed long prompt of its own takes the L3 path first (HPKV's server
starts on an engine's first lookup). Every hit must give the device hit's tokens and logprobs
and come from L3 (`meta_info.cached_tokens_details`). The target (HPKV's storage hit no slower
than the `file` backend's hit after a restart) is printed with PASS/MISS, never asserted. The
files of both backends are in the OS page cache: neither pays a disk read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.report import log, verdict
from hpkv.demo.model import BENCH, build_model, prompt_text
from hpkv.demo.sglang_engine import SglangCompletion, SglangServer
from hpkv.server import protocol

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv-sglang" / "bin" / "python"
COMPAT = REPO / "tests" / "sglang_cpu"
COMMON = ("--hicache-mem-layout", "page_first_direct", "--hicache-io-backend", "direct")
COMMON += ("--hicache-storage-prefetch-policy", "wait_complete")
FILE_L3 = ("--enable-hierarchical-cache", "--hicache-storage-backend", "file")
STEPS = ("cold", "device", "flush", "restart")


def _server(backend: str, model: Path, work: Path, env: dict[str, str]) -> SglangServer:
    extra = COMMON if backend == "hpkv" else COMMON + FILE_L3
    return SglangServer(
        str(model),
        env,
        hpkv=backend == "hpkv",
        launcher="serve",
        extra_flags=extra,
        python=str(PYTHON),
        log_path=work / f"sglang-{backend}.log",
    )


def _timed(engine: SglangServer, text: str) -> SglangCompletion:
    engine.complete("warm up", max_tokens=1)  # no row pays for an idle engine's first request
    return engine.complete(text)


def _wait_backed_up(engine: SglangServer, tokens: float, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.backed_up_tokens() < tokens and time.monotonic() < deadline:
        time.sleep(0.2)


def run_backend(backend: str, model: Path, work: Path, words: list[int]) -> dict:
    """TTFT (ms) of each step for each prompt length, and whether every hit was right."""
    env = {"PYTHONPATH": f"{COMPAT}:{REPO / 'src'}", "HF_HUB_OFFLINE": "1"}
    pool = Path(tempfile.mkdtemp(prefix="hpkv-bench-", dir="/dev/shm"))
    env.update(
        HPKV_KV_MEM_POOL_SIZE="2g",
        HPKV_SHARE_MEM_FILE_PATH=str(pool),
        HPKV_KV_STORAGE_PATH=str(work / f"{backend}-storage"),
        HPKV_CONFIG_FILE_PATH=str(work / "no-config.ini"),
        HPKV_SERVER_IDLE_EXIT_S="2",
        SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=str(work / "file-storage"),
    )
    out: dict = {"ttft_ms": {}, "right": True}
    texts = {n: prompt_text(n, seed=100 + n) for n in words}
    refs: dict[int, SglangCompletion] = {}
    try:
        for phase in ("first", "restart"):
            with _server(backend, model, work, env) as engine:
                log(f"{backend}: {phase} start done; warm-up prompt")
                warm = engine.complete(prompt_text(max(words), seed=7 if phase == "first" else 8), max_tokens=1)
                _wait_backed_up(engine, warm.prompt_tokens // 64 * 64 if phase == "first" else 0)
                for n in words:
                    row = out["ttft_ms"].setdefault(n, {})
                    if phase == "restart":
                        row["restart"] = _hit(engine, texts[n], refs[n], out)
                        continue
                    backed = engine.backed_up_tokens()
                    cold = _timed(engine, texts[n])
                    row["cold"] = cold.ttft_s * 1e3
                    refs[n] = _timed(engine, texts[n])
                    row["device"] = refs[n].ttft_s * 1e3
                    _wait_backed_up(engine, backed + cold.prompt_tokens // 64 * 64)
                    engine.flush_cache()
                    row["flush"] = _hit(engine, texts[n], refs[n], out)
            while (pool / protocol.SOCKET_NAME).exists():  # HPKV's DRAM goes with its server
                time.sleep(0.5)
    finally:
        shutil.rmtree(pool, ignore_errors=True)
    return out


def _hit(engine: SglangServer, text: str, reference: SglangCompletion, out: dict) -> float:
    hit = _timed(engine, text)
    right = hit.token_ids == reference.token_ids and hit.logprobs == reference.logprobs
    if not right or not hit.cached.get("storage"):
        log(f"not an identical L3 hit: {hit.cached}, identical={right}")
        out["right"] = False
    return hit.ttft_s * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-words", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not PYTHON.exists():
        print(f"{PYTHON} is missing: run `make setup`", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="hpkv-bench-sglang-"))
    model = build_model(work / "bench-qwen2", BENCH)
    results = {b: run_backend(b, model, work, args.prompt_words) for b in ("hpkv", "file")}
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'prompt':>7} {'step':<22} {'HPKV ms':>9} {'file ms':>9}")
    names = {"cold": "cold", "device": "device hit", "flush": "L3 after /flush_cache", "restart": "L3 after restart"}
    for n in args.prompt_words:
        for step in STEPS:
            h, f = results["hpkv"]["ttft_ms"][n][step], results["file"]["ttft_ms"][n][step]
            print(f"{n:>7} {names[step]:<22} {h:>9.0f} {f:>9.0f}")
        h, f = results["hpkv"]["ttft_ms"][n]["restart"], results["file"]["ttft_ms"][n]["restart"]
        print(f"{n:>7} HPKV storage / file after restart: {h / f:.2f} (target <= 1.00: {verdict(h <= f)})")
    print(f"every hit identical and from L3: {results['hpkv']['right'] and results['file']['right']}")
    print(f"logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
