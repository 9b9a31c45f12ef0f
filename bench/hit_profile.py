"""Where the time of a DRAM hit goes inside vLLM: HPKV's own steps against vLLM's forward pass.

    python -m bench.hit_profile [--prompt-words 8192] [--hits 12] [--json]

One HPKV engine (the documented launch, `hpkv.demo.model.BENCH`) serves one prompt, computed
once; then, --hits times: `/reset_prefix_cache` and a DRAM hit, then the same prompt again as
vLLM's own prefix-cache hit. Each timed request follows an untimed tiny one, as in
bench.vllm_ttft, and starts once the storage directory has been quiet for 1 s and synced.

The engine's processes time a few functions through a `sitecustomize` module put on their
PYTHONPATH (one trace file per process, under --workdir): the scheduler's lookup and lease, the
worker's lease, copy and release, and vLLM's `execute_model` and `schedule`. For each hit the
report gives its TTFT, HPKV's part (scheduler lease; worker load, copy included) and the step
that computes the prompt's last token: `execute_model` of that step less the worker's load is
vLLM's own forward pass. Printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.harness.engine import WAKE_PROMPT, Engine, engine_env
from bench.harness.report import log
from hpkv.demo.model import BENCH, build_model, prompt_text
from hpkv.demo.scenario import documented_env

MIN_STEP_S = 0.005  # a step that runs the model takes over 15 ms on this CPU; an empty one under 1 ms

SHIM = """\
import functools, importlib.abc, importlib.util, os, sys, time
_OUT = open(os.path.join({trace_dir!r}, f"trace-{{os.getpid()}}.log"), "a", buffering=1)
TARGETS = {{
    "hpkv.integrations.vllm.scheduler": [("HpkvScheduler", "_lease")],
    "hpkv.integrations.vllm.worker": [("HpkvWorker", "_load")],
    "hpkv.transfer.blocks": [("BlockCopier", "load")],
    "vllm.v1.worker.gpu_model_runner": [("GPUModelRunner", "execute_model")],
}}
def _wrap(cls, name, label):
    fn = getattr(cls, name)
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        started = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            _OUT.write(f"{{started:.6f}} {{time.time():.6f}} {{label}}\\n")
    setattr(cls, name, timed)
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            for cls, method in TARGETS[name]:
                _wrap(getattr(module, cls), method, method)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _Finder())
"""


@dataclass
class Hit:
    kind: str  # "dram" or "in-engine"
    index: int
    ttft_ms: float
    scheduler_lease_ms: float | None
    worker_load_ms: float | None
    copy_ms: float | None
    step_ms: float | None  # execute_model of the step that computed the prompt's last token
    forward_ms: float | None  # step_ms less the worker's load
    sources: dict[str, float]


def read_traces(trace_dir: Path) -> list[tuple[float, float, str]]:
    spans = []
    for path in trace_dir.glob("trace-*.log"):
        for line in path.read_text().splitlines():
            start, end, label = line.split()
            spans.append((float(start), float(end), label))
    return sorted(spans)


def breakdown(spans, kind: str, index: int, sent: float, ttft_s: float, sources) -> Hit:
    """The spans of one timed request: from its send to its first token."""
    inside = [s for s in spans if sent <= s[0] <= sent + ttft_s]

    def first(label):
        return next((s for s in inside if s[2] == label), None)

    def ms(span):
        return None if span is None else (span[1] - span[0]) * 1e3

    lease, load, copy = first("_lease"), first("_load"), first("load")
    # The prompt's step: the first that ran the model. Steps with nothing scheduled (under 1 ms
    # here) can still follow the untimed request's last one.
    step = next((s for s in inside if s[2] == "execute_model" and s[1] - s[0] >= MIN_STEP_S), None)
    forward = None if step is None else ms(step) - (ms(load) or 0.0)
    return Hit(kind, index, ttft_s * 1e3, ms(lease), ms(load), ms(copy), ms(step), forward, sources)


def settle(storage: Path, quiet_s: float = 1.0) -> None:
    last, since = None, time.monotonic()
    while time.monotonic() - since < quiet_s or last is None:
        usage = sum(f.stat().st_size for f in storage.rglob("*") if f.is_file())
        if usage != last:
            last, since = usage, time.monotonic()
        time.sleep(0.25)
    os.sync()


def timed(engine: Engine, prompt: str, spans_out: list, kind: str, index: int) -> None:
    before = engine.counters()
    engine.complete(WAKE_PROMPT, 1)
    sent = time.time()
    completion = engine.complete(prompt, 8)
    after = engine.counters()
    sources = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("device", "host", "disk")}
    spans_out.append((kind, index, sent, completion.ttft_s, sources))


def summarize(hits: list[Hit]) -> dict:
    out = {}
    for kind in ("dram", "in-engine"):
        rows = [h for h in hits if h.kind == kind]
        fields = ("ttft_ms", "scheduler_lease_ms", "worker_load_ms", "copy_ms", "step_ms", "forward_ms")
        out[kind] = {
            f: statistics.median(v) if (v := [getattr(h, f) for h in rows if getattr(h, f) is not None]) else None
            for f in fields
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "hpkv-hit-profile")
    p.add_argument("--prompt-words", type=int, default=8192)
    p.add_argument("--hits", type=int, default=12, help="DRAM hits (and as many in-engine hits)")
    p.add_argument("--pool-size", default="2g")
    p.add_argument(
        "--pool-parent",
        type=Path,
        default=Path("/dev/shm"),
        help="where the pool's directory is made (a tmpfs; see docs/operations.md on huge pages)",
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    a.workdir.mkdir(parents=True, exist_ok=True)
    model = str(build_model(a.workdir / "bench-model", BENCH))
    trace_dir = a.workdir / "traces"
    shutil.rmtree(trace_dir, ignore_errors=True)
    trace_dir.mkdir()
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-hit-profile-", dir=a.pool_parent))
    storage = Path(tempfile.mkdtemp(prefix="storage-", dir=a.workdir))
    env = {**engine_env(), **documented_env(a.pool_size, pool_dir, storage, a.workdir)}
    (a.workdir / "logs").mkdir(exist_ok=True)
    engine = Engine(
        "hpkv", model, env, hpkv=True, log_dir=a.workdir / "logs", shim=SHIM.format(trace_dir=str(trace_dir))
    )
    sends: list = []
    try:
        engine.start()
        engine.warm_up(prompt_text(a.prompt_words, seed=-2))
        prompt = prompt_text(a.prompt_words, seed=777)
        engine.complete(prompt, 1)  # computed and saved
        for i in range(a.hits):
            engine.reset_prefix_cache()
            settle(storage)
            timed(engine, prompt, sends, "dram", i)
            settle(storage)
            timed(engine, prompt, sends, "in-engine", i)
            log(f"hit {i}: DRAM {sends[-2][3] * 1e3:.0f} ms, in-engine {sends[-1][3] * 1e3:.0f} ms")
    finally:
        engine.stop()
        shutil.rmtree(pool_dir, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
    spans = read_traces(trace_dir)
    hits = [breakdown(spans, kind, i, sent, ttft_s, sources) for kind, i, sent, ttft_s, sources in sends]
    report = {
        "command": " ".join([sys.executable, *sys.argv]),
        "prompt_words": a.prompt_words,
        "hits": [asdict(h) for h in hits],
        "medians": summarize(hits),
    }
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(hits, report["medians"])
    return 0


def print_report(hits: list[Hit], medians: dict) -> None:
    def f(value) -> str:
        return "-" if value is None else f"{value:.1f}"

    print(f"{'hit':<12}{'TTFT':>8}{'sched lease':>13}{'worker load':>13}{'copy':>8}{'step':>8}{'forward':>9}  cached")
    for h in hits:
        cached = "/".join(f"{h.sources.get(k, 0):.0f}" for k in ("device", "host", "disk"))
        print(
            f"{h.kind + ' ' + str(h.index):<12}{f(h.ttft_ms):>8}{f(h.scheduler_lease_ms):>13}"
            f"{f(h.worker_load_ms):>13}{f(h.copy_ms):>8}{f(h.step_ms):>8}{f(h.forward_ms):>9}  {cached}"
        )
    for kind, m in medians.items():
        print(f"median {kind}: " + ", ".join(f"{k} {f(v)} ms" for k, v in m.items()))


if __name__ == "__main__":
    sys.exit(main())
