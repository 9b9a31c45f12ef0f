"""Peer comparison on vLLM: HPKV against LMCache, and both against vLLM's own prefix cache.

    python -m bench.peers [--lengths 2048,8192,16384] [--repeats 3] [--json]

One run serves one prefill-heavy random Qwen2 (`hpkv.demo.model.BENCH`, built locally) with real
vLLM engines, all with the same flags, on the same machine, and measures one system after the
other:
- off: no connector (recompute), and vLLM's own prefix-cache hit (the in-engine limit);
- hpkv: HpkvConnectorV1 as documented; DRAM hit after /reset_prefix_cache, storage hit after an
  engine restart once the auto-started HPKV server has exited (its DRAM is gone);
- lmcache: LMCache 0.5.6 in multi-process mode (`lmcache server`, L1 DRAM and an `fs` L2 on the
  same disk as HPKV's storage) with vLLM's LMCacheMPConnector; L1 hit after /reset_prefix_cache,
  L2 hit after restarting both its server and vLLM (its L1 is gone).

Workloads: (a) TTFT of single prompts of each length, cold and hit from each tier; (b) multi-round
long-document QA, many users, more documents than the engine's KV cache holds; (c) throughput of
distinct prompts that share nothing (the connectors' overhead). Every hit's token ids are
compared with the in-engine hit's (a) or the connector-off engine's (b), and each hit's tier is
read from vLLM's per-source cached-token counters. Targets are printed with PASS/MISS and never
asserted. Progress goes to stderr; tables (or `--json`) to stdout; plots to --plots-dir. Engine
and LMCache logs stay under <workdir>/logs; pools, storage and L2 directories are removed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from bench.harness.engine import (
    WAKE_PROMPT,
    Engine,
    Sample,
    compare,
    hpkv_server_alive,
    start_together,
    wait_for_hpkv_server_exit,
)
from bench.harness.report import log
from bench.lmcache_peer import LMCacheServer
from bench.multiround import Workload, drive
from bench.peers_report import EXTERNAL, HPKV_LOAD, ROWS, SYSTEMS, header, plot, print_report, summarize
from hpkv.demo.engine import VllmServer
from hpkv.demo.model import BENCH, TINY, build_model, prompt_text
from hpkv.demo.scenario import documented_env

BLOCK_SIZE = 32  # the documented --block-size
WORKLOADS = ("ttft", "noreuse", "multiround")


@dataclass(frozen=True)
class Options:
    model: str | None
    tiny: bool
    workdir: Path
    plots_dir: Path | None
    lengths: tuple[int, ...]
    repeats: int
    max_tokens: int
    kv_cache_tokens: int
    pool_size: str
    l1_size_gb: float
    workload: Workload
    users: int
    answer_tokens: int
    tput_prompts: int
    tput_words: int
    tput_concurrency: int
    tput_max_tokens: int
    tput_rounds: int
    json: bool
    json_out: Path | None
    workloads: tuple[str, ...] = WORKLOADS
    pool_parent: Path = Path("/dev/shm")


@dataclass
class Results:
    ttft: dict[str, dict[int, list[Sample]]] = field(default_factory=lambda: {r: {} for r in ROWS})
    noreuse: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})
    noreuse_cpu: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})
    # per round, each request's (time to first token, time after it), in seconds
    noreuse_requests: dict[str, list[list[tuple[float, float]]]] = field(
        default_factory=lambda: {s: [] for s in SYSTEMS}
    )
    multiround: dict[str, dict] = field(default_factory=dict)
    notes: dict[str, object] = field(default_factory=dict)


# -- engines --------------------------------------------------------------------------------


class PeerEngine(Engine):
    """The harness's Engine with extra vLLM flags (the KV cache size, LMCache's connector)."""

    def __init__(
        self, name: str, kind: str, model: str, env: dict[str, str], flags: tuple[str, ...], log_dir: Path
    ) -> None:
        super().__init__(name, model, env, hpkv=kind == "hpkv", log_dir=log_dir)
        self.kind = kind
        self.server = VllmServer(
            model, self.env, hpkv=kind == "hpkv", extra_flags=flags, log_path=log_dir / f"vllm-{name}.log"
        )

    def sources(self) -> dict[str, float]:
        c = self.counters()
        out = {k: v for k, v in c.items() if k in ("device", *EXTERNAL, *HPKV_LOAD)}
        out["external"] = sum(c.get(k, 0.0) for k in EXTERNAL)
        return out

    def measure_all(self, prompt: str, max_tokens: int):
        """Engine.measure (an untimed tiny request first), with every cached-token source."""
        before = self.sources()
        self.complete(WAKE_PROMPT, 1)
        completion = self.complete(prompt, max_tokens)
        after = self.sources()
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
        return completion, Sample(completion.ttft_s, completion.prompt_tokens, delta)

    def warm_up_paths(self, opts: Options, prompt: str) -> None:
        """Engine.warm_up (computed or stored-tier hit, in-engine hit, HPKV DRAM hit, a batch),
        plus LMCache's L1 hit on an LMCache engine."""
        self.warm_up(prompt, opts.tput_concurrency)
        if self.kind == "lmcache":
            self.reset_prefix_cache()
            self.complete(prompt, 2)


class Systems:
    """The engines of one run and LMCache's server; `restart_connectors` gives HPKV and LMCache
    engines with empty DRAM tiers over the same storage / L2 directory."""

    def __init__(self, opts: Options, model: str, pool_dir: Path, storage_dir: Path, l2_dir: Path) -> None:
        self.opts, self.model = opts, model
        self.pool_dir, self.storage_dir, self.l2_dir = pool_dir, storage_dir, l2_dir
        self.log_dir = opts.workdir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # VLLM_CPU_KVCACHE_SPACE counts whole GiB, and overrides --kv-cache-memory-bytes: 1 GiB
        # (the least) holds 128K tokens of this model. The engine's cache is cut to fewer blocks
        # instead, so that the multi-round documents outgrow it at a size this machine computes.
        self.flags = ("--num-gpu-blocks-override", str(opts.kv_cache_tokens // BLOCK_SIZE))
        self.hpkv_env = documented_env(opts.pool_size, pool_dir, storage_dir, opts.workdir)
        self.lmcache_servers: list[LMCacheServer] = []
        self.engines: list[PeerEngine] = []
        self.life = 0

    def lmcache_server(self) -> LMCacheServer:
        server = LMCacheServer(self.opts.l1_size_gb, self.l2_dir, self.log_dir / f"lmcache-{self.life}.log")
        self.lmcache_servers.append(server)
        started = time.monotonic()
        server.start()
        log(f"lmcache server: up in {time.monotonic() - started:.0f} s (log {server.log_path})")
        return server

    def engine(self, kind: str, server: LMCacheServer | None = None) -> PeerEngine:
        name = kind if self.life == 0 else f"{kind}-restarted"
        env = self.hpkv_env if kind == "hpkv" else {}
        flags = self.flags + (("--kv-transfer-config", server.kv_transfer_config()) if server else ())
        engine = PeerEngine(name, kind, self.model, env, flags, self.log_dir)
        self.engines.append(engine)
        return engine

    def start_all(self) -> dict[str, PeerEngine]:
        server = self.lmcache_server()
        engines = {"off": self.engine("off"), "hpkv": self.engine("hpkv"), "lmcache": self.engine("lmcache", server)}
        start_together(list(engines.values()))
        return engines

    def restart_connectors(self, engines: dict[str, PeerEngine]) -> dict[str, PeerEngine]:
        engines["hpkv"].stop()
        engines["lmcache"].stop()
        files, num_bytes = self.lmcache_servers[-1].wait_l2_settled()
        self.lmcache_servers[-1].stop()
        log(
            f"LMCache server stopped, L2 holds {files} chunks ({num_bytes / 2**20:.0f} MiB); "
            f"HPKV server exited after {wait_for_hpkv_server_exit(self.pool_dir):.1f} s"
        )
        self.life += 1
        server = self.lmcache_server()
        restarted = {"off": engines["off"], "hpkv": self.engine("hpkv"), "lmcache": self.engine("lmcache", server)}
        start_together([restarted["hpkv"], restarted["lmcache"]])
        return restarted

    def settle(self, quiet_s: float = 1.0, timeout_s: float = 60.0) -> float:
        """Until neither HPKV's storage nor LMCache's L2 directory has changed for quiet_s, then
        until their dirty pages are on disk: the kernel writes them back about 30 s later
        otherwise, on whatever request of whichever system runs then (on this VM's ext4 that
        writeback costs CPU time the two cores do not have spare). Returns the seconds the sync
        took."""
        deadline = time.monotonic() + timeout_s
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            now = [dir_usage(d) for d in (self.storage_dir, self.l2_dir)]
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
            time.sleep(0.25)
        synced = time.monotonic()
        os.sync()
        return time.monotonic() - synced

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()
        for server in self.lmcache_servers:
            server.stop()


# -- the workloads --------------------------------------------------------------------------


def ttft_prompts(opts: Options) -> dict[int, list[str]]:
    return {n: [prompt_text(n, seed=10_000 * n + r) for r in range(opts.repeats)] for n in opts.lengths}


def ttft_hits_in_dram(opts: Options, results: Results, engines: dict[str, PeerEngine], settle) -> dict:
    """Per prompt: cold and in-engine hit (the reference) with no connector; cold, reset, DRAM
    hit on HPKV; cold, reset, L1 hit on LMCache. Each timed request waits for the write-through
    of the cold requests before it (HPKV's storage, LMCache's L2) to end: on two cores that
    background work would land on whichever request comes next, of any system. The in-engine hit
    waits the same way, although nothing is written before it, so that every hit starts from
    the same state. The in-engine hit is also timed as before (row engine_hit_busy): sent right
    after the cold prefill, with no pause, it finds the machine busy, which the hits after a
    pause do not."""
    references = {}
    for n, prompts in ttft_prompts(opts).items():
        for r, prompt in enumerate(prompts):
            settle()
            _, cold = engines["off"].measure_all(prompt, opts.max_tokens)
            _, busy = engines["off"].measure_all(prompt, opts.max_tokens)
            settle()
            reference, hit = engines["off"].measure_all(prompt, opts.max_tokens)
            references[prompt] = reference
            add(results, "cold", n, cold)
            add(results, "engine_hit_busy", n, busy)
            add(results, "engine_hit", n, hit)
            for kind, row in (("hpkv", "hpkv_dram"), ("lmcache", "lmcache_l1")):
                engine = engines[kind]
                settle()
                _, cold_on = engine.measure_all(prompt, opts.max_tokens)
                add(results, f"{kind}_cold", n, cold_on)
                engine.reset_prefix_cache()
                settle()
                completion, sample = engine.measure_all(prompt, opts.max_tokens)
                add(results, row, n, compare(sample, completion, reference))
            log(
                f"{n} words, repeat {r}: cold {ms(cold)}, in-engine {ms(hit)}, HPKV DRAM "
                f"{ms(results.ttft['hpkv_dram'][n][-1])}, LMCache L1 {ms(results.ttft['lmcache_l1'][n][-1])}"
            )
    return references


def ttft_hits_in_storage(
    opts: Options, results: Results, engines: dict[str, PeerEngine], references: dict, settle
) -> None:
    for n, prompts in ttft_prompts(opts).items():
        for r, prompt in enumerate(prompts):
            for kind, row in (("hpkv", "hpkv_storage"), ("lmcache", "lmcache_l2")):
                settle()
                completion, sample = engines[kind].measure_all(prompt, opts.max_tokens)
                add(results, row, n, compare(sample, completion, references[prompt]))
            log(
                f"{n} words, repeat {r}: HPKV storage {ms(results.ttft['hpkv_storage'][n][-1])}, "
                f"LMCache L2 {ms(results.ttft['lmcache_l2'][n][-1])}"
            )


def noreuse(opts: Options, results: Results, engines: dict[str, PeerEngine], systems: Systems) -> None:
    """Rounds of distinct prompts, each round sent to every system; the order of the systems
    runs through every permutation, so a drift in the machine's load hits all alike. First one
    untimed batch of the same shape on each engine (a first large batched prefill pays one-time
    costs). A system's round lasts until its last answer, or until the last file its connector
    wrote for the round (HPKV's write-through, LMCache's L2) if that came later, plus the
    `os.sync` of their dirty pages: each system is charged with its own background work, and the
    next one starts on an idle machine."""
    warm = [prompt_text(opts.tput_words, seed=-99_999 - i) for i in range(opts.tput_concurrency)]
    for engine in engines.values():
        engine.send_concurrently(warm, opts.tput_concurrency, opts.tput_max_tokens)
    systems.settle()
    orders = list(itertools.permutations(SYSTEMS))
    for round_index in range(opts.tput_rounds):
        prompts = [
            prompt_text(opts.tput_words, seed=-100_000 * (round_index + 1) - i) for i in range(opts.tput_prompts)
        ]
        for kind in orders[round_index % len(orders)]:
            before = round_costs(engines[kind], systems)
            started = time.time()
            completions = engines[kind].send_all(prompts, opts.tput_concurrency, opts.tput_max_tokens)
            answered = time.time()
            sync_s = systems.settle()
            written = max(newest_mtime(systems.storage_dir, started), newest_mtime(systems.l2_dir, started))
            elapsed = max(answered, written) - started + sync_s
            costs = {k: round(v - before.get(k, 0.0), 3) for k, v in round_costs(engines[kind], systems).items()}
            results.noreuse[kind].append((len(prompts), elapsed))
            results.noreuse_cpu[kind].append(costs)
            # Where a slow round lost its time: waiting for the first token, or decoding after it.
            requests = [(round(c.ttft_s, 3), round(c.total_s - c.ttft_s, 3)) for c in completions]
            results.noreuse_requests[kind].append(requests)
            log(
                f"no-reuse round {round_index}, {kind}: {len(prompts) / elapsed:.2f} req/s (answered in "
                f"{answered - started:.2f} s, files until {max(written - started, 0):.2f} s, sync {sync_s:.2f} s); "
                f"longest wait for a first token {max(t for t, _ in requests):.2f} s, longest decode "
                f"{max(d for _, d in requests):.2f} s; CPU s (round and settle): {costs}"
            )


def round_costs(engine: PeerEngine, systems: Systems) -> dict[str, float]:
    """CPU seconds so far of the engine's processes, of the HPKV and LMCache servers, of the
    whole machine; and, on an HPKV engine, the worker's save counters. Taken around a no-reuse
    round, they say what each system spent on it, and where."""
    out = {
        "engine": process_tree_cpu(engine.server.process.pid),
        "hpkv_server": sum(
            process_tree_cpu(p.pid)
            for p in psutil.process_iter(["cmdline"])
            if "hpkv.server.daemon" in (p.info["cmdline"] or [])
        ),
        "lmcache_server": sum(
            process_tree_cpu(s.process.pid)
            for s in systems.lmcache_servers
            if s.process is not None and s.process.poll() is None
        ),
        "machine": sum(getattr(psutil.cpu_times(), f) for f in ("user", "system", "nice", "irq", "softirq")),
    }
    if engine.kind == "hpkv":
        c = engine.counters()
        out.update({k: c.get(k, 0.0) for k in ("hpkv_save_time_s", "hpkv_save_wait_s", "hpkv_saved_blocks")})
    return out


def process_tree_cpu(pid: int) -> float:
    """User + system CPU seconds of a process and its children (0 for parts that are gone)."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in family:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def multiround(opts: Options, results: Results, engines: dict[str, PeerEngine]) -> None:
    """The same requests on every system, one system after the other, each engine's own prefix
    cache emptied first; outputs compared with the connector-off engine's, request by request.
    Then the connector-off engine once more ("off_again"): how many answers vLLM itself changes
    from one run of this concurrent workload to the next, the floor for the comparisons."""
    requests = opts.workload.requests()
    for kind in (*SYSTEMS, "off_again"):
        engine = engines["off" if kind == "off_again" else kind]
        engine.reset_prefix_cache()
        before = engine.counters()
        outcomes, wall_s = drive(requests, engine.complete, opts.users, opts.answer_tokens)
        after = engine.counters()
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k != "finished"}
        results.multiround[kind] = {"outcomes": outcomes, "wall_s": wall_s, "counters": delta}
        ttfts = [o.ttft_s for o in outcomes]
        log(
            f"multi-round, {kind}: {len(outcomes)} requests in {wall_s:.1f} s "
            f"({len(outcomes) / wall_s:.2f} req/s), TTFT median {np.median(ttfts) * 1e3:.0f} ms"
        )


def run(opts: Options, results: Results, pool_dir: Path, storage_dir: Path, l2_dir: Path) -> None:
    shape = TINY if opts.tiny else BENCH
    model = opts.model or str(build_model(opts.workdir / ("tiny-model" if opts.tiny else "bench-model"), shape))
    systems = Systems(opts, model, pool_dir, storage_dir, l2_dir)
    warm = {kind: prompt_text(max(opts.lengths), seed=-1 - i) for i, kind in enumerate(SYSTEMS)}
    try:
        log("starting LMCache's server, then the no-connector, HPKV and LMCache engines")
        engines = systems.start_all()
        for kind, engine in engines.items():
            engine.warm_up_paths(opts, warm[kind])
        if "ttft" in opts.workloads:
            references = ttft_hits_in_dram(opts, results, engines, systems.settle)
            results.notes["hpkv_counters_before_restart"] = hpkv_counters(engines["hpkv"])
            results.notes["lmcache_status_before_restart"] = brief_status(systems.lmcache_servers[-1])
            engines = systems.restart_connectors(engines)
            results.notes["lmcache_status_after_restart"] = brief_status(systems.lmcache_servers[-1])
            results.notes["hpkv_server_alive_after_restart"] = hpkv_server_alive(pool_dir)
            for kind in ("hpkv", "lmcache"):  # in storage / L2 only now
                engines[kind].warm_up_paths(opts, warm[kind])
            ttft_hits_in_storage(opts, results, engines, references, systems.settle)
        if "noreuse" in opts.workloads:
            noreuse(opts, results, engines, systems)
        if "multiround" in opts.workloads:
            multiround(opts, results, engines)
        results.notes["lmcache_status_end"] = brief_status(systems.lmcache_servers[-1])
        results.notes["hpkv_counters_end"] = hpkv_counters(engines["hpkv"])
    finally:
        systems.stop()


def dir_usage(path: Path) -> tuple[int, int]:
    """(files, bytes) under path; a file renamed or removed while counted is skipped."""
    num_files = num_bytes = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                num_bytes += os.stat(os.path.join(root, name)).st_size
                num_files += 1
            except FileNotFoundError:
                pass
    return num_files, num_bytes


def newest_mtime(path: Path, since: float) -> float:
    """The latest modification time (wall clock) of a file under path, if after `since`; else 0."""
    newest = 0.0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                newest = max(newest, os.stat(os.path.join(root, name)).st_mtime)
            except FileNotFoundError:
                pass
    return newest if newest > since else 0.0


def hpkv_counters(engine: PeerEngine) -> dict[str, float]:
    return {k: v for k, v in engine.counters().items() if k.startswith("hpkv_")}


def add(results: Results, row: str, n: int, sample: Sample) -> None:
    results.ttft[row].setdefault(n, []).append(sample)


def ms(sample: Sample) -> str:
    return f"{sample.ttft_s * 1e3:.0f} ms"


def brief_status(server: LMCacheServer) -> object:
    try:
        return server.status()
    except Exception as exc:  # only a note in the report
        return f"unavailable: {exc}"


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model directory (default: build the BENCH random model)")
    p.add_argument("--tiny", action="store_true", help="build the TINY model instead (quick checks)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "hpkv-peers",
        help="model cache, logs, storage and L2 temporaries (on disk, not /dev/shm)",
    )
    p.add_argument(
        "--plots-dir",
        default=str(Path(__file__).resolve().parent.parent / "docs" / "img"),
        help="where peers_*.png go ('' for none)",
    )
    p.add_argument("--lengths", default="2048,8192,16384", help="words per TTFT prompt (~1 token each)")
    p.add_argument("--repeats", type=int, default=5, help="TTFT prompts per length")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=49_152,
        help="vLLM's own KV cache, every engine (at least the model's 32,768-token context)",
    )
    p.add_argument("--pool-size", default="2g", help="HPKV_KV_MEM_POOL_SIZE")
    p.add_argument(
        "--pool-parent",
        type=Path,
        default=Path("/dev/shm"),
        help="where HPKV's pool directory is made (a tmpfs; see docs/operations.md on huge pages)",
    )
    p.add_argument("--l1-size-gb", type=float, default=2.0, help="LMCache's L1 (DRAM), like the HPKV pool")
    p.add_argument("--documents", type=int, default=24)
    p.add_argument("--document-words", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--users", type=int, default=4, help="concurrent users in the multi-round workload")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--tput-prompts", type=int, default=8)
    p.add_argument("--tput-words", type=int, default=1536)
    p.add_argument("--tput-concurrency", type=int, default=4)
    p.add_argument("--tput-max-tokens", type=int, default=16)
    p.add_argument("--tput-rounds", type=int, default=6, help="no-reuse rounds (6: every order of the 3)")
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="which of (a) ttft, (c) noreuse, (b) multiround to run, comma-separated",
    )
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.add_argument("--json-out", type=Path, help="also write the JSON to this file")
    a = p.parse_args(argv)
    workload = Workload(num_documents=a.documents, document_words=a.document_words, num_rounds=a.rounds)
    workloads = tuple(w.strip() for w in a.workloads.split(",") if w.strip())
    unknown = set(workloads) - set(WORKLOADS)
    if unknown or not workloads:
        p.error(f"--workloads: {', '.join(sorted(unknown)) or 'none given'}; choose from {', '.join(WORKLOADS)}")
    return Options(
        a.model,
        a.tiny,
        a.workdir,
        Path(a.plots_dir) if a.plots_dir else None,
        tuple(int(x) for x in a.lengths.split(",")),
        a.repeats,
        a.max_tokens,
        a.kv_cache_tokens,
        a.pool_size,
        a.l1_size_gb,
        workload,
        a.users,
        a.answer_tokens,
        a.tput_prompts,
        a.tput_words,
        a.tput_concurrency,
        a.tput_max_tokens,
        a.tput_rounds,
        a.json,
        a.json_out,
        workloads,
        a.pool_parent,
    )


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    opts.workdir.mkdir(parents=True, exist_ok=True)
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-peers-", dir=opts.pool_parent))
    storage_dir = Path(tempfile.mkdtemp(prefix="storage-", dir=opts.workdir))
    l2_dir = Path(tempfile.mkdtemp(prefix="lmcache-l2-", dir=opts.workdir))
    head = header(opts, pool_dir, storage_dir)
    log(f"command: {head['command']}")
    results, started = Results(), time.monotonic()
    try:
        run(opts, results, pool_dir, storage_dir, l2_dir)
    finally:
        for path in (pool_dir, storage_dir, l2_dir):
            shutil.rmtree(path, ignore_errors=True)
    head["elapsed_s"] = time.monotonic() - started
    summary = summarize(results)
    if opts.plots_dir:
        head["plots"] = plot(summary, opts.plots_dir)
    if opts.json_out:
        opts.json_out.write_text(json.dumps({**head, **summary}, indent=2, default=float))
    if opts.json:
        print(json.dumps({**head, **summary}, indent=2, default=float))
    else:
        print_report(summary, head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
