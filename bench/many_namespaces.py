"""Benchmark: `hpkv status` and `hpkv clear --model` on a storage directory of many namespaces.

A storage directory shared by a node's engines over months holds a namespace per model, rank and
load-time variant ever served. This script fills a fresh directory with `--namespaces` of them in
HPKV's layout, each with its `namespace.json` (`StorageTier.add_namespace`) and one entry file
(`write_from`), starts a real `hpkv server` on it, waits for its start-up scan, and times (best
of `--repeats`, as subprocesses, as an operator runs them):
- `hpkv status`, against the same on an empty storage directory measured in this run (target:
  at most 2x);
- `hpkv status --json` (every namespace the server holds, page by page);
- `hpkv clear --model NAME` of one model among them (reads every `namespace.json` and checks it
  hashes to its directory; target: under 10 s per 100,000 namespaces).
Also reported: how long the start-up scan took. Directories are removed at the end.

    .venv/bin/python -m bench.many_namespaces [--namespaces 100000] [--storage-dir /tmp] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import configs
from bench.harness.keys import key, namespace
from bench.harness.report import log, verdict
from bench.harness.server import SHM, server_env, start_server, stop_server
from hpkv.server.client import Client
from hpkv.storage.storage_tier import StorageTier

HPKV = Path(sys.executable).parent / "hpkv"
STATUS_RATIO_TARGET = 2.0
CLEAR_S_PER_100K_TARGET = 10.0


def fill(storage_dir: Path, num: int) -> float:
    """`num` namespaces, each with its description and one 4 KiB entry file; seconds taken."""
    tier = StorageTier(configs.storage(storage_dir, capacity_bytes=1 << 50))
    tier.start()
    payload = memoryview(bytes(4096))
    started = time.perf_counter()
    for i in range(num):
        desc = namespace(f"HPKV_MODEL_ID:model-{i}", 4096)
        tier.add_namespace(desc.ns, desc.to_json())
        if not tier.write_from(desc.ns, key(f"many-{i}"), payload):
            raise SystemExit(f"could not write namespace {i} under {storage_dir}")
        if i and i % 20_000 == 0:
            log(f"{i} namespaces written")
    tier.close()
    return time.perf_counter() - started


def timed(env: dict[str, str], *args: str, repeats: int) -> float:
    """The best wall time of `hpkv ARGS` in `repeats` runs; exits if one fails."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        result = subprocess.run([str(HPKV), *args], env=env, capture_output=True, text=True, timeout=600)
        best = min(best, time.perf_counter() - started)
        if result.returncode != 0:
            raise SystemExit(f"hpkv {' '.join(args)} failed: {result.stderr[-2000:]}")
    return best


def measure(storage_dir: Path, repeats: int, model: str | None) -> dict[str, float]:
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-bench-ns-", dir=SHM))
    try:
        env = server_env(pool_dir, storage_dir, HPKV_KV_MEM_POOL_SIZE="64m", HPKV_KV_STORAGE_SIZE="1t")
        started = time.perf_counter()
        server = start_server(env)
        try:
            with Client(pool_dir, kind="bench", autostart=False) as client:
                while not client.stats().storage.index_ready:  # type: ignore[union-attr]
                    time.sleep(0.1)
            row = {"scan_s": time.perf_counter() - started}
            row["status_s"] = timed(env, "status", repeats=repeats)
            row["status_json_s"] = timed(env, "status", "--json", repeats=repeats)
            if model is not None:
                row["clear_model_s"] = timed(env, "clear", "--model", model, repeats=repeats)
            return row
        finally:
            stop_server(server)
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--namespaces", type=int, default=100_000)
    parser.add_argument("--storage-dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    empty = Path(tempfile.mkdtemp(prefix="hpkv-bench-ns-empty-", dir=args.storage_dir))
    full = Path(tempfile.mkdtemp(prefix="hpkv-bench-ns-", dir=args.storage_dir))
    try:
        log("baseline: an empty storage directory")
        baseline = measure(empty, args.repeats, None)
        log(f"writing {args.namespaces} namespaces under {full}")
        fill_s = fill(full, args.namespaces)
        log(f"written in {fill_s:.1f} s; starting a server on them")
        row = measure(full, args.repeats, "model-7")
    finally:
        shutil.rmtree(empty, ignore_errors=True)
        shutil.rmtree(full, ignore_errors=True)
    ratio = row["status_s"] / baseline["status_s"]
    clear_per_100k = row["clear_model_s"] * 100_000 / args.namespaces
    result = {
        "namespaces": args.namespaces,
        "fill_s": round(fill_s, 1),
        "scan_s": round(row["scan_s"], 2),
        "status_empty_s": round(baseline["status_s"], 3),
        "status_s": round(row["status_s"], 3),
        "status_ratio": round(ratio, 2),
        "status_json_s": round(row["status_json_s"], 3),
        "clear_model_s": round(row["clear_model_s"], 2),
        "status_verdict": verdict(ratio <= STATUS_RATIO_TARGET),
        "clear_verdict": verdict(clear_per_100k <= CLEAR_S_PER_100K_TARGET),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.namespaces} namespaces on disk (one entry file each); server's start-up scan {result['scan_s']} s")
    print(
        f"hpkv status: {result['status_s']} s, {result['status_ratio']}x an empty directory's "
        f"{result['status_empty_s']} s (target <= {STATUS_RATIO_TARGET}x): {result['status_verdict']}"
    )
    print(f"hpkv status --json: {result['status_json_s']} s")
    print(
        f"hpkv clear --model: {result['clear_model_s']} s (target <= {CLEAR_S_PER_100K_TARGET} s per "
        f"100,000 namespaces): {result['clear_verdict']}"
    )


if __name__ == "__main__":
    main()
