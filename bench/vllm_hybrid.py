"""Hybrid models on vLLM: storage bytes per cached token and DRAM-hit TTFT against vLLM's own hit.

    python -m bench.vllm_hybrid [--family gemma3|qwen3next] [--repeats 3] [--prompt-words 4096] [--json]

One run serves a random hybrid model built locally with vLLM's hybrid KV cache manager on, from
an engine without HPKV and one with it, side by side: a Gemma 3 (`bench.harness.hybrid_model.
BENCH`: 8 layers alternating a 128-token sliding window and full attention) or a Qwen3-Next
(`BENCH_NEXT`: 8 layers, 3 Gated DeltaNet to 1 full attention), and measures in the same run:

- TTFT of vLLM's own prefix-cache hit (the engine without HPKV, the prompt sent twice);
- TTFT of an HPKV DRAM hit (the HPKV engine computes the prompt, `/reset_prefix_cache`, again),
  whose token ids must be the in-engine hit's and whose prefix must come from the host tier;
- the engines' KV cache sizes (vLLM's "KV cache size: N tokens"), which must be equal, and that
  of a third engine with the hybrid manager off (what vLLM kept when HPKV did not support it);
- the storage HPKV wrote per cached token, by kind of KV cache group (sliding window, full
  attention, linear-attention states), against the KV a model of the same layers, all full
  attention, holds per token.

Each engine takes every timed path once untimed first (`Engine.warm_up`). Targets are printed
with PASS/MISS, never asserted. docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench.harness.engine import Engine, compare, engine_env, start_together
from bench.harness.hybrid_model import BENCH, BENCH_NEXT, build_gemma3, build_qwen3_next
from bench.harness.report import log, verdict
from hpkv.demo.model import prompt_text
from hpkv.demo.scenario import documented_env

TTFT_TARGET = 1.5  # HPKV DRAM hit / vLLM's own hit, at most (bench.vllm_ttft's target)
START_TIMEOUT_S = 1800  # three first compiles of a wide model at once on two cores


def kv_cache_tokens(engine: Engine) -> int:
    log_path = engine.server.log_path
    text = log_path.read_text(errors="replace") if log_path else ""
    sizes = re.findall(r"KV cache size: ([\d,]+) tokens", text)
    return int(sizes[-1].replace(",", "")) if sizes else -1


def storage_per_token(storage: Path) -> dict[str, float]:
    """Bytes of KV files per cached token, by the kind of KV cache group each namespace.json
    names; cached tokens are the blocks of the namespace with the most entries (a full-attention
    group's: every block) times the block size."""
    sizes: dict[str, float] = {}
    num_tokens = 0
    for ns in sorted(p for p in storage.iterdir() if (p / "namespace.json").is_file()):
        text = (ns / "namespace.json").read_text()
        files = list(ns.rglob("*.kv"))
        kind = next((k for spec, k in KINDS if spec in text), "full attention")
        sizes[kind] = sizes.get(kind, 0.0) + sum(f.stat().st_size for f in files)
        num_tokens = max(num_tokens, len(files) * int(json.loads(text).get("block_size", 32)))
    return {kind: size / num_tokens for kind, size in sizes.items()} if num_tokens else {}


KINDS = (("SlidingWindowSpec", "sliding window"), ("MambaSpec", "linear-attention states"))


def run(args, workdir: Path) -> dict:
    if args.family == "qwen3next":
        model, shape = str(build_qwen3_next(workdir / "bench-qwen3next", BENCH_NEXT)), BENCH_NEXT
        name = f"Qwen3-Next, {shape.num_layers} layers, 3 Gated DeltaNet to 1 full attention"
    else:
        model, shape = str(build_gemma3(workdir / "bench-gemma3", BENCH)), BENCH
        name = f"Gemma 3, {shape.num_layers} layers, window {BENCH.window}"
    pool, storage, logs = workdir / "pool", workdir / "storage", workdir / "logs"
    for path in (pool, storage, logs):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    on_env = {**engine_env(), **documented_env("2g", pool, storage, workdir), "VLLM_HPKV_TOKEN_THRESHOLD": "0"}
    wait = START_TIMEOUT_S
    off = Engine("hybrid-off", model, engine_env(), hpkv=False, log_dir=logs, start_timeout_s=wait)
    on = Engine("hybrid-hpkv", model, on_env, hpkv=True, log_dir=logs, start_timeout_s=wait)
    manager_off = Engine(
        "hybrid-manager-off",
        model,
        engine_env(),
        hpkv=False,
        log_dir=logs,
        extra_flags=("--disable-hybrid-kv-cache-manager",),
        start_timeout_s=wait,
    )
    engines = [off, on, manager_off] if args.family == "gemma3" else [off, on]  # vLLM needs it on for Mamba
    rows: dict[str, list[float]] = {"engine_hit": [], "dram": []}
    checks: list[bool] = []
    try:
        start_together(engines)
        manager_off.stop()  # only its KV cache size is read
        off.warm_up(prompt_text(args.prompt_words, seed=-11))
        on.warm_up(prompt_text(args.prompt_words, seed=-12))
        for r in range(args.repeats):
            prompt = prompt_text(args.prompt_words, seed=2000 + r)
            off.measure(prompt, args.max_tokens)
            reference, hit = off.measure(prompt, args.max_tokens)
            on.measure(prompt, args.max_tokens)
            on.reset_prefix_cache()
            completion, dram = on.measure(prompt, args.max_tokens)
            compare(dram, completion, reference)
            checks.append(bool(dram.same_ids) and dram.sources["host"] > 0)
            rows["engine_hit"].append(hit.ttft_s)
            rows["dram"].append(dram.ttft_s)
            log(f"repeat {r}: in-engine hit {hit.ttft_s * 1e3:.0f} ms, DRAM hit {dram.ttft_s * 1e3:.0f} ms")
        capacity = {
            "off": kv_cache_tokens(off),
            "hpkv": kv_cache_tokens(on),
            "manager_off": kv_cache_tokens(manager_off) if manager_off in engines else -1,
        }
    finally:
        for engine in engines:
            engine.stop()
    medians = {name: statistics.median(values) for name, values in rows.items()}
    per_token = storage_per_token(storage)
    head_bytes = 2 * shape.num_kv_heads * shape.head_dim * 2  # K and V, bf16, one layer, one token
    return {
        "model": name,
        "prompt_tokens": completion.prompt_tokens,
        "ttft_ms": {name: value * 1e3 for name, value in medians.items()},
        "ratio": medians["dram"] / medians["engine_hit"],
        "same_ids_and_host_tier": all(checks),
        "kv_cache_tokens": capacity,
        "storage_bytes_per_token": per_token,
        "full_attention_kv_bytes_per_token": head_bytes * shape.num_layers,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_hybrid", description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("gemma3", "qwen3next"), default="gemma3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-words", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "hpkv-hybrid-bench")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = run(args, args.workdir)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    t = out["ttft_ms"]
    print(f"model: {out['model']}; prompt {out['prompt_tokens']} tokens")
    print(f"TTFT: vLLM's own hit {t['engine_hit']:.0f} ms, HPKV DRAM hit {t['dram']:.0f} ms")
    print(f"DRAM hit / in-engine hit: {out['ratio']:.2f} (<= {TTFT_TARGET}: {verdict(out['ratio'] <= TTFT_TARGET)})")
    print(f"same token ids as vLLM's hit, prefix from HPKV's host tier: {out['same_ids_and_host_tier']}")
    cap = out["kv_cache_tokens"]
    print(
        f"KV cache size: {cap['off']} tokens without HPKV, {cap['hpkv']} with ({verdict(cap['off'] == cap['hpkv'])}); "
        + (f"{cap['manager_off']} with the hybrid manager off" if cap["manager_off"] >= 0 else "")
    )
    stored = out["storage_bytes_per_token"]
    print(
        "storage per cached token: "
        + ", ".join(f"{kind} {value:.0f} B" for kind, value in stored.items())
        + f"; total {sum(stored.values()):.0f} B; all-full-attention KV {out['full_attention_kv_bytes_per_token']} B"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
