"""VLLM_HPKV_TOKEN_THRESHOLD=auto against the two fixed extremes, on a real vLLM, in one run.

    python -m bench.threshold_auto [--repeats 2] [--long-tokens 8192] [--short-hits 32,64,128,256,512] [--json]

Three HPKV engines serve the prefill-heavy random Qwen2 `hpkv.demo.model.BENCH` side by side,
started as the documentation says, each with its own pool and storage directory, and differing
only in the threshold:

- always: VLLM_HPKV_TOKEN_THRESHOLD=0 (the smallest value accepted): every hit is loaded;
- never:  VLLM_HPKV_TOKEN_THRESHOLD=1000000000: every hit is recomputed;
- auto:   VLLM_HPKV_TOKEN_THRESHOLD=auto: the measured cost model decides per tier.

Each engine gets the same requests, one engine after the other (the order rotates), never two
at once:
- long, DRAM: a prompt of --long-tokens tokens is computed, `/reset_prefix_cache`, then sent again;
- long, storage: the same with another prompt, once its KV files have landed, after
  `/reset_prefix_cache?reset_external=true` (which also empties the engine's HPKV DRAM entries);
- short: a prefix of H tokens (each of --short-hits) is computed, `/reset_prefix_cache`, then sent
  with --suffix-tokens new tokens after it: an HPKV DRAM hit of H tokens.

Each engine first takes every path once untimed (which also lets auto measure this machine). A
request's TTFT is the median of --samples sends of it (the hit is restored before each: the
device cache reset again, for storage HPKV's DRAM too; a short hit gets a fresh suffix each
time). Each send waits until the storage writes so far are on disk (`os.sync`), then --settle-s
after the previous engine's request, so that engine's idle threads have stopped spinning on the
two cores (vLLM's shared-memory message queues busy-wait for 1 s after their last message:
`SpinCondition(busy_loop_s=1)` in vllm/distributed/device_communicators/shm_broadcast.py), and
follows an untimed tiny request to its own engine, as in bench.vllm_ttft. The check, per request: auto's TTFT
is not more than 10% over the slower of the two fixed policies (PASS), i.e. auto is never worse than both.
Printed, never asserted. Progress on stderr, the table (or --json) on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.harness.engine import Engine, engine_env, start_together
from bench.harness.report import log
from hpkv.benchmark.machine import describe
from hpkv.demo.model import BENCH, build_model, prompt_text
from hpkv.demo.scenario import documented_env

POLICIES = {"always": "0", "never": "1000000000", "auto": "auto"}
TOLERANCE = 1.10
BLOCK_SIZE = 32


@dataclass(frozen=True)
class Options:
    model: str | None
    workdir: Path
    repeats: int
    long_tokens: int
    short_hits: tuple[int, ...]
    suffix_tokens: int
    samples: int
    settle_s: float
    pool_size: str
    json: bool


@dataclass
class Row:
    scenario: str
    hit_tokens: int
    repeat: int
    ttft_ms: dict[str, float]  # median of the samples
    samples_ms: dict[str, list[float]]
    loaded: dict[str, dict[str, float]]  # policy -> cached prompt tokens by source (device/host/disk)
    same_ids: bool  # the three policies generated the same tokens

    @property
    def worst_fixed_ms(self) -> float:
        return max(self.ttft_ms["always"], self.ttft_ms["never"])

    @property
    def passed(self) -> bool:
        return self.ttft_ms["auto"] <= TOLERANCE * self.worst_fixed_ms


class Bench:
    def __init__(self, opts: Options, engines: dict[str, Engine], storage: dict[str, Path]) -> None:
        self.opts = opts
        self.engines = engines
        self.storage = storage
        self.rows: list[Row] = []
        self._turn = 0

    def tokens(self, num: int, seed: int) -> list[int]:
        """`num` token ids of a fresh random text (the demo tokenizer: about one token a word)."""
        engine = self.engines["auto"]
        ids = engine.server.post(
            "/tokenize", {"model": engine.server.served_name, "prompt": prompt_text(num + 16, seed)}
        )["tokens"]
        return ids[:num]

    def order(self) -> list[str]:
        names = list(POLICIES)
        self._turn += 1
        return names[self._turn % 3 :] + names[: self._turn % 3]

    # -- the scenarios ------------------------------------------------------------------------

    def num_samples(self, repeat: int | None) -> int:
        return 1 if repeat is None else self.opts.samples

    def long_dram(self, ids: list[int], repeat: int | None) -> None:
        for name in POLICIES:
            self.engines[name].complete(ids, 1)
        self.measure(
            "long, DRAM", [ids] * self.num_samples(repeat), len(ids) // BLOCK_SIZE * BLOCK_SIZE, repeat, external=False
        )

    def long_storage(self, ids: list[int], repeat: int | None) -> None:
        for name in POLICIES:
            before = count_files(self.storage[name])
            self.engines[name].complete(ids, 1)
            wait_for_files(self.storage[name], before + len(ids) // BLOCK_SIZE)
        self.measure(
            "long, storage",
            [ids] * self.num_samples(repeat),
            len(ids) // BLOCK_SIZE * BLOCK_SIZE,
            repeat,
            external=True,
        )

    def short(self, hit: int, seed: int, repeat: int | None) -> None:
        prefix = self.tokens(hit, seed)
        for name in POLICIES:
            self.engines[name].complete(prefix, 1)
        prompts = [prefix + self.tokens(self.opts.suffix_tokens, seed + 1 + s) for s in range(self.num_samples(repeat))]
        self.measure("short, DRAM", prompts, hit, repeat, external=False)

    def measure(self, scenario: str, prompts: list[list[int]], hit: int, repeat: int | None, external: bool) -> None:
        """Each prompt sent to every engine, after resetting the engine's device cache (and with
        `external`, its HPKV DRAM entries) so that the hit is where the scenario wants it."""
        samples: dict[str, list[float]] = {name: [] for name in POLICIES}
        loaded, outputs = {}, {}
        for ids in prompts:
            for name in self.order():
                reset(self.engines[name], external)
                os.sync()  # the write-throughs' dirty pages: written back now, not inside a request
                time.sleep(self.opts.settle_s)
                completion, sample = self.engines[name].measure(ids, 4)
                samples[name].append(sample.ttft_s * 1e3)
                loaded[name], outputs[name] = sample.sources, completion.token_ids
        if repeat is None:
            return  # a warm-up
        ttft = {name: statistics.median(values) for name, values in samples.items()}
        row = Row(scenario, hit, repeat, ttft, samples, loaded, len({tuple(o or ()) for o in outputs.values()}) == 1)
        self.rows.append(row)
        log(
            f"{scenario}, hit {hit}, repeat {repeat}: "
            + ", ".join(f"{n} {ttft[n]:.0f} ms ({'/'.join(f'{v:.0f}' for v in samples[n])})" for n in POLICIES)
            + f" -> {'PASS' if row.passed else 'MISS'}"
        )

    def run(self) -> None:
        o = self.opts
        log("warm-up: every path once on every engine, untimed")
        self.long_dram(self.tokens(o.long_tokens, seed=-1), None)
        self.long_storage(self.tokens(o.long_tokens, seed=-2), None)
        for hit in o.short_hits:
            self.short(hit, seed=-1000 - hit, repeat=None)
        for r in range(o.repeats):
            self.long_dram(self.tokens(o.long_tokens, seed=1000 + r), r)
            self.long_storage(self.tokens(o.long_tokens, seed=2000 + r), r)
            for hit in o.short_hits:
                self.short(hit, seed=3000 + 100 * r + hit, repeat=r)


def reset(engine: Engine, external: bool) -> None:
    # vLLM refuses while a finishing request still holds blocks: try again briefly.
    deadline = time.monotonic() + 10
    while not engine.server.reset_prefix_cache(external) and time.monotonic() < deadline:
        time.sleep(0.1)


def count_files(storage: Path) -> int:
    return sum(1 for _ in storage.rglob("*.kv"))


def wait_for_files(storage: Path, at_least: int, timeout_s: float = 60.0) -> None:
    """The HPKV server writes through on its own threads: wait until the request's files landed."""
    deadline = time.monotonic() + timeout_s
    while count_files(storage) < at_least or any(storage.rglob("*.tmp")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{at_least} KV files under {storage} after {timeout_s:.0f} s")
        time.sleep(0.1)


def auto_lines(engine: Engine) -> list[str]:
    text = engine.server.log_path.read_text(errors="replace")
    lines = [
        line[line.index("VLLM_HPKV") :] for line in text.splitlines() if "VLLM_HPKV_TOKEN_THRESHOLD=auto (" in line
    ]
    starts = [i for i, line in enumerate(lines) if "auto (start," in line]
    return lines[starts[-1] :] if starts else lines  # this run's (the log file is appended to)


# -- report ---------------------------------------------------------------------------------


def summarize(rows: list[Row], lines: list[str]) -> dict:
    return {
        "rows": [{**asdict(r), "worst_fixed_ms": r.worst_fixed_ms, "passed": r.passed} for r in rows],
        "passed": all(r.passed for r in rows),
        "num_miss": sum(not r.passed for r in rows),
        "auto_log": lines,
    }


def print_report(summary: dict, head: dict) -> None:
    print(f"command: {head['command']}")
    m = head["machine"]
    print(f"machine: {m['cpus']} CPUs ({m['cpu_model']}), load {m['load_avg_1m']} at start; model {head['model']}")
    print(
        f"\n{'scenario':<15} {'hit':>6} {'rep':>3} {'always':>8} {'never':>8} {'auto':>8}  "
        f"{'auto loaded (host/disk)':>23} {'same ids':>8}  check"
    )
    for r in summary["rows"]:
        t = r["ttft_ms"]
        loaded = r["loaded"]["auto"]
        print(
            f"{r['scenario']:<15} {r['hit_tokens']:>6} {r['repeat']:>3} {t['always']:>6.0f}ms {t['never']:>6.0f}ms "
            f"{t['auto']:>6.0f}ms  {loaded.get('host', 0):>11.0f}/{loaded.get('disk', 0):<11.0f} "
            f"{'yes' if r['same_ids'] else 'NO':>8}  {'PASS' if r['passed'] else 'MISS'}"
        )
    print("\nauto's log (start, then each material change):")
    for line in summary["auto_log"]:
        print(f"  {line}")
    verdict = "PASS" if summary["passed"] else f"MISS ({summary['num_miss']} requests)"
    print(f"\nno request under auto slower than both fixed policies by more than {TOLERANCE - 1:.0%}: {verdict}")
    print(f"{head['elapsed_s']:.0f} s in all")


def parse_args(argv: list[str]) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model directory (default: build the BENCH random model)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "hpkv-threshold-bench",
        help="model cache, logs and storage temporaries (on disk, not /dev/shm)",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--long-tokens", type=int, default=8192)
    p.add_argument("--short-hits", default="32,64,128,256,512", help="hit sizes of the short workload (tokens)")
    p.add_argument("--suffix-tokens", type=int, default=256, help="new tokens after a short hit")
    p.add_argument("--samples", type=int, default=5, help="sends of each request; its TTFT is their median")
    p.add_argument("--settle-s", type=float, default=1.5, help="pause before each send (see above)")
    p.add_argument("--pool-size", default="1g", help="HPKV_KV_MEM_POOL_SIZE of each engine")
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    a = p.parse_args(argv)
    hits = tuple(int(h) for h in a.short_hits.split(","))
    return Options(
        a.model, a.workdir, a.repeats, a.long_tokens, hits, a.suffix_tokens, a.samples, a.settle_s, a.pool_size, a.json
    )


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    opts.workdir.mkdir(parents=True, exist_ok=True)
    (opts.workdir / "logs").mkdir(exist_ok=True)
    model = opts.model or str(build_model(opts.workdir / "bench-model", BENCH))
    pools = {n: Path(tempfile.mkdtemp(prefix=f"hpkv-thr-{n}-", dir="/dev/shm")) for n in POLICIES}
    storage = {n: Path(tempfile.mkdtemp(prefix=f"storage-{n}-", dir=opts.workdir)) for n in POLICIES}
    head = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": describe(pools["auto"], storage["auto"]),
        "model": model,
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
    }
    log(f"command: {head['command']}")
    envs = {
        n: {
            **engine_env(),
            **documented_env(opts.pool_size, pools[n], storage[n], opts.workdir),
            "VLLM_HPKV_TOKEN_THRESHOLD": value,
        }
        for n, value in POLICIES.items()
    }
    engines = {n: Engine(n, model, envs[n], hpkv=True, log_dir=opts.workdir / "logs") for n in POLICIES}
    started = time.monotonic()
    try:
        start_together(list(engines.values()))
        bench = Bench(opts, engines, storage)
        bench.run()
    finally:
        for engine in engines.values():
            engine.stop()
        for path in (*pools.values(), *storage.values()):
            shutil.rmtree(path, ignore_errors=True)
    lines = auto_lines(engines["auto"])
    head["elapsed_s"] = time.monotonic() - started
    summary = summarize(bench.rows, lines)
    if opts.json:
        print(json.dumps({**head, **summary}, indent=2, default=float))
    else:
        print_report(summary, head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
