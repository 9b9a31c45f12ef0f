"""vLLM end to end: time to first token on HPKV hits, and throughput when nothing is reused.

    python -m bench.vllm_ttft [--repeats 3] [--prompt-words 8192] [--model PATH] [--json]

One run serves one prefill-heavy random Qwen2 (`hpkv.demo.model.BENCH`, built locally) with a
real vLLM, started as the documentation says, and measures in the same run:

- TTFT, cold: a connector-OFF engine, a prompt it has never seen (the recompute baseline);
- TTFT, vLLM prefix-cache hit: the same prompt again on that engine (the in-engine limit);
- TTFT, HPKV DRAM hit: an HPKV engine computes the prompt, `/reset_prefix_cache`, the prompt again;
- TTFT, HPKV storage hit: that engine restarted once its auto-started HPKV server has exited (so
  HPKV's DRAM is gone), the prompt again;
- throughput with no reuse: the same sets of distinct prompts sent concurrently to the OFF
  engine and to the HPKV engine, in alternating rounds.

Every repeat uses a new prompt. Each engine first takes every path it is timed on once,
untimed, with a prompt of its own (`Engine.warm_up`), and every timed request follows an
untimed tiny one (`Engine.measure`), so no row pays one-time or after-idle costs that another
does not. A hit must give the token ids of the in-engine hit, and must come from the tier it is
named after (vLLM's per-source cached-token counters). Targets are printed with PASS/MISS and
never asserted. Progress goes to stderr; the table (or `--json`) to stdout. Engine logs stay
under <workdir>/logs; pool and storage temporaries are removed. docs/benchmarks.md has the
figures and what each row measures.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.harness.engine import Engine, Sample, compare, engine_env, start_together, wait_for_hpkv_server_exit
from bench.harness.report import log, verdict
from hpkv.benchmark.machine import describe
from hpkv.demo.engine import Completion, documented_flags
from hpkv.demo.model import BENCH, build_model, prompt_text
from hpkv.demo.scenario import documented_env

TARGETS = {  # ratio name -> (numerator row, denominator row, bound, "<=" or ">=")
    "DRAM hit / in-engine hit": ("dram", "engine_hit", 1.5, "<="),
    "DRAM hit / cold": ("dram", "cold", 0.2, "<="),
    "storage hit / cold": ("storage", "cold", 0.3, "<="),
}
TPUT_TARGET = 0.95
ROWS = {  # row -> what it measures
    "cold": "cold, connector OFF (recompute)",
    "engine_hit": "vLLM prefix-cache hit (OFF engine)",
    "cold_on": "cold, HPKV engine (computes + saves)",
    "engine_hit_on": "vLLM prefix-cache hit (HPKV engine)",
    "dram": "HPKV DRAM hit (after /reset_prefix_cache)",
    "storage": "HPKV storage hit (engine restarted)",
}


@dataclass(frozen=True)
class Options:
    model: str | None
    workdir: Path
    prompt_words: int
    repeats: int
    max_tokens: int
    pool_size: str
    tput_prompts: int
    tput_words: int
    tput_concurrency: int
    tput_max_tokens: int
    tput_rounds: int
    json: bool
    async_save: str = "default"  # the HPKV engine's "hpkv.async_save": default, on or off


@dataclass
class Results:
    samples: dict[str, list[Sample]] = field(default_factory=lambda: {name: [] for name in ROWS})
    tput: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: {"off": [], "on": []})
    tput_connector: dict[str, float] = field(default_factory=dict)  # HPKV's own time in the ON rounds
    hpkv_counters: dict[str, dict[str, float]] = field(default_factory=dict)


# -- the run --------------------------------------------------------------------------------


def connector_flags(opts: Options) -> tuple[str, ...]:
    """The documented --kv-transfer-config, with "hpkv.async_save" when --async-save says so."""
    if opts.async_save == "default":
        return ()
    config = {
        "kv_connector": "HpkvConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"hpkv.async_save": opts.async_save == "on"},
    }
    return ("--kv-transfer-config", json.dumps(config))


def hpkv_env(opts: Options, pool_dir: Path, storage_dir: Path) -> dict[str, str]:
    """The documented exports, as the demo uses them (threshold: its default)."""
    return documented_env(opts.pool_size, pool_dir, storage_dir, opts.workdir)


def run(opts: Options, results: Results, pool_dir: Path, storage_dir: Path) -> None:
    model = opts.model or str(build_model(opts.workdir / "bench-model", BENCH))
    log_dir = opts.workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    on_env = {**engine_env(), **hpkv_env(opts, pool_dir, storage_dir)}
    prompts = [prompt_text(opts.prompt_words, seed=1000 + r) for r in range(opts.repeats)]
    off = Engine("off", model, engine_env(), hpkv=False, log_dir=log_dir)
    flags = connector_flags(opts)
    on = Engine("hpkv", model, on_env, hpkv=True, log_dir=log_dir, extra_flags=flags)
    restarted = Engine("hpkv-restarted", model, on_env, hpkv=True, log_dir=log_dir, extra_flags=flags)
    try:
        log("starting the connector-OFF engine and the HPKV engine")
        start_together([off, on])
        warm = [prompt_text(opts.prompt_words, seed=-1 - r) for r in range(2)]
        off.warm_up(warm[0], opts.tput_concurrency)
        on.warm_up(warm[1], opts.tput_concurrency)
        references = [ttft_repeat(opts, results, off, on, prompt, r) for r, prompt in enumerate(prompts)]
        results.hpkv_counters["hpkv"] = on.counters()
        on.stop()
        log(f"HPKV engine stopped; its HPKV server exited after {wait_for_hpkv_server_exit(pool_dir):.1f} s")
        restarted.start()
        restarted.warm_up(warm[1], opts.tput_concurrency)  # in storage only, since the HPKV server exited
        for r, prompt in enumerate(prompts):
            completion, sample = restarted.measure(prompt, opts.max_tokens)
            results.samples["storage"].append(compare(sample, completion, references[r]))
            log(f"repeat {r}: storage hit {sample.ttft_s * 1e3:.0f} ms, sources {sample.sources}")
        throughput(opts, results, off, restarted)
        results.hpkv_counters["hpkv-restarted"] = restarted.counters()
    finally:
        for engine in (off, on, restarted):
            engine.stop()


def ttft_repeat(opts: Options, results: Results, off: Engine, on: Engine, prompt: str, r: int) -> Completion:
    """One fresh prompt: cold and in-engine hit on the OFF engine; cold, in-engine hit and DRAM
    hit on the HPKV engine. Returns the in-engine hit (the reference output)."""
    s = results.samples
    _, cold = off.measure(prompt, opts.max_tokens)
    reference, engine_hit = off.measure(prompt, opts.max_tokens)
    s["cold"].append(cold)
    s["engine_hit"].append(engine_hit)
    _, cold_on = on.measure(prompt, opts.max_tokens)
    s["cold_on"].append(cold_on)
    completion, engine_hit_on = on.measure(prompt, opts.max_tokens)
    s["engine_hit_on"].append(compare(engine_hit_on, completion, reference))
    on.reset_prefix_cache()
    completion, dram = on.measure(prompt, opts.max_tokens)
    s["dram"].append(compare(dram, completion, reference))
    log(
        f"repeat {r} ({cold.prompt_tokens} tokens): cold {cold.ttft_s * 1e3:.0f} ms, in-engine hit "
        f"{engine_hit.ttft_s * 1e3:.0f} ms, cold+save {cold_on.ttft_s * 1e3:.0f} ms, DRAM hit "
        f"{dram.ttft_s * 1e3:.0f} ms, sources {dram.sources}"
    )
    return reference


def throughput(opts: Options, results: Results, off: Engine, on: Engine) -> None:
    """Rounds, each with its own prompts, sent to both engines; which goes first alternates
    (OFF ON, ON OFF, ...), so a drift in the machine's load hits both sides alike. First, one
    untimed batch of the same shape on each engine: an engine's first large batched prefill pays
    one-time costs (seconds here), and only the OFF engine has run large prefills before."""
    warm = [prompt_text(opts.tput_words, seed=99_999 - i) for i in range(opts.tput_concurrency)]
    for engine in (off, on):
        engine.send_concurrently(warm, opts.tput_concurrency, opts.tput_max_tokens)
    before = on.counters()
    for round_index in range(opts.tput_rounds):
        prompts = [prompt_text(opts.tput_words, seed=100_000 * (round_index + 1) + i) for i in range(opts.tput_prompts)]
        order = [("off", off), ("on", on)] if round_index % 2 == 0 else [("on", on), ("off", off)]
        for side, engine in order:
            elapsed = engine.send_concurrently(prompts, opts.tput_concurrency, opts.tput_max_tokens)
            results.tput[side].append((len(prompts), elapsed))
            log(
                f"throughput round {round_index}, connector {side.upper()}: {len(prompts)} requests "
                f"in {elapsed:.1f} s ({len(prompts) / elapsed:.2f} req/s)"
            )
    after = on.counters()
    results.tput_connector = {
        k: after.get(f"hpkv_{k}", 0.0) - before.get(f"hpkv_{k}", 0.0) for k in ("save_time_s", "saved_blocks")
    }


# -- the report -----------------------------------------------------------------------------


def summarize(results: Results) -> dict:
    rows = {}
    for name, samples in results.samples.items():
        ttfts = [s.ttft_s for s in samples]
        if not ttfts:
            continue
        rows[name] = {
            "measure": ROWS[name],
            "n": len(ttfts),
            "median_ms": float(np.median(ttfts)) * 1e3,
            "p90_ms": float(np.percentile(ttfts, 90)) * 1e3,
            "prompt_tokens": samples[0].prompt_tokens,
            "cached_tokens": {
                k: float(np.median([s.sources.get(k, 0) for s in samples])) for k in ("device", "host", "disk")
            },
            "same_token_ids": None if samples[0].same_ids is None else all(s.same_ids for s in samples),
            "same_logprobs": None if samples[0].same_logprobs is None else all(s.same_logprobs for s in samples),
            "samples_ms": [round(t * 1e3, 1) for t in ttfts],
        }
    ratios = {}
    for label, (num, den, bound, sense) in TARGETS.items():
        if num in rows and den in rows:
            value = rows[num]["median_ms"] / rows[den]["median_ms"]
            ratios[label] = {
                "value": value,
                "target": f"{sense} {bound}",
                "passed": value <= bound if sense == "<=" else value >= bound,
            }
    return {
        "ttft": rows,
        "ratios": ratios,
        "throughput": summarize_tput(results),
        "checks": checks(rows),
        "hpkv_counters": results.hpkv_counters,
    }


def summarize_tput(results: Results) -> dict:
    out = {}
    for side, runs in results.tput.items():
        if runs:
            out[f"{side}_req_per_s"] = sum(n for n, _ in runs) / sum(t for _, t in runs)
            out[f"{side}_rounds_req_per_s"] = [round(n / t, 3) for n, t in runs]
    if "off_req_per_s" in out and "on_req_per_s" in out:
        ratio = out["on_req_per_s"] / out["off_req_per_s"]
        out["ratio"] = {"value": ratio, "target": f">= {TPUT_TARGET}", "passed": ratio >= TPUT_TARGET}
        # What the connector itself spent on the engine's critical path (worker saves), a figure
        # the machine's noise does not move the way it moves requests/s.
        on_s = sum(t for _, t in results.tput["on"])
        out["connector"] = {
            **results.tput_connector,
            "on_rounds_s": on_s,
            "save_share": results.tput_connector.get("save_time_s", 0.0) / on_s,
        }
    return out


def checks(rows: dict) -> dict[str, bool]:
    """A hit must match the in-engine hit's tokens and come from the tier it is named after."""
    out = {}
    for name, source in (("dram", "host"), ("storage", "disk")):
        if name in rows:
            row = rows[name]
            out[f"{name}: same token ids as the in-engine hit"] = bool(row["same_token_ids"])
            out[f"{name}: prefix came from HPKV {source} tier"] = row["cached_tokens"][source] > 0
    return out


def print_report(summary: dict, header: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))  # not squeezed to 80 columns in a pipe
    console.print(f"command: {header['command']}")
    m = header["machine"]
    console.print(
        f"machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_bytes'] / 2**30:.0f} GiB, "
        f"kernel {m['kernel']}, load {m['load_avg_1m']} at start; vllm {header['versions']['vllm']}, "
        f"torch {header['versions']['torch']}; model {header['model']}"
    )
    table = Table(title="vLLM end to end: time to first token")
    for col in ("measure", "tokens", "median", "p90", "n", "cached (device/host/disk)", "same ids"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    for row in summary["ttft"].values():
        cached = "/".join(f"{row['cached_tokens'][k]:.0f}" for k in ("device", "host", "disk"))
        same = {None: "-", True: "yes", False: "NO"}[row["same_token_ids"]]
        table.add_row(
            row["measure"],
            str(row["prompt_tokens"]),
            f"{row['median_ms']:.0f} ms",
            f"{row['p90_ms']:.0f} ms",
            str(row["n"]),
            cached,
            same,
        )
    console.print(table)
    ratios = Table(title="ratios (medians)")
    for col in ("ratio", "value", "target", "result"):
        ratios.add_column(col)
    for label, r in summary["ratios"].items():
        ratios.add_row(label, f"{r['value']:.3f}", r["target"], verdict(r["passed"]))
    t = summary["throughput"]
    if "ratio" in t:
        ratios.add_row(
            f"no-reuse throughput ON / OFF ({t['on_req_per_s']:.3f} / {t['off_req_per_s']:.3f} req/s)",
            f"{t['ratio']['value']:.3f}",
            t["ratio"]["target"],
            verdict(t["ratio"]["passed"]),
        )
    console.print(ratios)
    for label, ok in summary["checks"].items():
        console.print(f"check: {label}: {'yes' if ok else 'NO'}")
    if "on_rounds_req_per_s" in t:
        console.print(f"throughput rounds (req/s): OFF {t['off_rounds_req_per_s']}, ON {t['on_rounds_req_per_s']}")
    if "connector" in t:
        c = t["connector"]
        console.print(
            f"connector in the ON rounds: saves took {c['save_time_s']:.2f} s of {c['on_rounds_s']:.0f} s "
            f"({c['save_share']:.1%}; {c['saved_blocks']:.0f} blocks)"
        )
    for name, counters in summary["hpkv_counters"].items():
        console.print(f"HPKV counters of engine '{name}': {load_save_line(counters)}")
    console.print(f"{header['elapsed_s']:.0f} s in all")


def load_save_line(c: dict[str, float]) -> str:
    parts = []
    for kind, done in (("load", "loaded"), ("save", "saved")):
        seconds, num_bytes = c.get(f"hpkv_{kind}_time_s", 0.0), c.get(f"hpkv_{done}_bytes", 0.0)
        rate = f"{num_bytes / seconds / 1e9:.2f} GB/s" if seconds else "-"
        parts.append(f"{done} {num_bytes / 2**20:.0f} MiB in {seconds * 1e3:.0f} ms ({rate})")
    return ", ".join(parts)


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model directory (default: build the BENCH random model)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "hpkv-vllm-bench",
        help="model cache, logs and storage temporaries (on disk, not /dev/shm)",
    )
    p.add_argument("--prompt-words", type=int, default=8192, help="words per TTFT prompt (~1 token each)")
    p.add_argument("--repeats", type=int, default=3, help="TTFT prompts, each measured on every row")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--pool-size", default="2g", help="HPKV_KV_MEM_POOL_SIZE")
    p.add_argument("--tput-prompts", type=int, default=8, help="distinct prompts per throughput round")
    p.add_argument("--tput-words", type=int, default=1536)
    p.add_argument("--tput-concurrency", type=int, default=4)
    p.add_argument("--tput-max-tokens", type=int, default=16)
    p.add_argument("--tput-rounds", type=int, default=4, help="rounds, each sent to OFF and ON (order alternates)")
    p.add_argument(
        "--async-save",
        choices=("default", "on", "off"),
        default="default",
        help='the HPKV engine\'s "hpkv.async_save" (default: off on a CPU, on on accelerators)',
    )
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    a = p.parse_args(argv)
    return Options(
        a.model,
        a.workdir,
        a.prompt_words,
        a.repeats,
        a.max_tokens,
        a.pool_size,
        a.tput_prompts,
        a.tput_words,
        a.tput_concurrency,
        a.tput_max_tokens,
        a.tput_rounds,
        a.json,
        a.async_save,
    )


def header(opts: Options, pool_dir: Path, storage_dir: Path, model: str) -> dict:
    import torch
    import vllm

    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "engine_command_on": shlex.join(
            [
                "python",
                "-m",
                "vllm.entrypoints.openai.api_server",
                *documented_flags(model, 8000, "hpkv-demo", hpkv=True, extra=connector_flags(opts)),
            ]
        ),
        "machine": describe(pool_dir, storage_dir),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "model": model,
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
    }


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    opts.workdir.mkdir(parents=True, exist_ok=True)
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-vllm-bench-", dir="/dev/shm"))
    storage_dir = Path(tempfile.mkdtemp(prefix="storage-", dir=opts.workdir))
    model = opts.model or str(opts.workdir / "bench-model")
    head = header(opts, pool_dir, storage_dir, model)
    log(f"command: {head['command']}")
    log(
        f"HPKV engine: {' '.join(f'{k}={v}' for k, v in hpkv_env(opts, pool_dir, storage_dir).items())} "
        f"{head['engine_command_on']}"
    )
    results, started = Results(), time.monotonic()
    try:
        run(opts, results, pool_dir, storage_dir)
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)
        shutil.rmtree(storage_dir, ignore_errors=True)
    head["elapsed_s"] = time.monotonic() - started
    summary = summarize(results)
    if opts.json:
        print(json.dumps({**head, **summary}, indent=2, default=float))
    else:
        print_report(summary, head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
