"""Benchmark: the server's lookups and its write-through on a CPU the engine keeps busy.

For each `HPKV_WRITE_NICE` value (and once with no writes, the baseline), one after another in
the same run: a real server with its storage tier on disk; as many busy processes as CPUs (an
engine's compute threads); one client committing 32 entries of 256 KiB every 50 ms (640
entries/s, each written through to storage); and this process looking up a 64-key prefix every
20 ms. Reports the lookups' round trip (p50, p90, p99, max; p99 also as a ratio to the
baseline's) and how many of the committed entries reached storage during the run.

    .venv/bin/python -m bench.write_contention [--nice 0,10,19] [--seconds 15] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.harness.keys import keys as _keys
from bench.harness.keys import namespace
from bench.harness.server import temporary_server
from hpkv.keys import NamespaceDesc
from hpkv.server.client import Client

ENTRY = 256 << 10
BATCH = 32
BATCH_EVERY_S = 0.05
LOOKUP_EVERY_S = 0.02
BUSY = "while True:\n    pass\n"


def _desc(entry_bytes: int) -> NamespaceDesc:
    return namespace("server", entry_bytes, dtype="bfloat16", num_layers=1)  # the server benchmark's


def run_one(nice: int | None, seconds: float, storage_parent: Path) -> dict:
    """One server; `nice` None: no writes (the baseline)."""
    busy: list[subprocess.Popen] = []
    with contextlib.ExitStack() as stack:
        pool_dir, storage = stack.enter_context(
            temporary_server("hpkv-bench-wc-", storage_parent, HPKV_WRITE_NICE=str(nice or 0))
        )
        stack.callback(_kill_all, busy)
        client = Client(pool_dir, kind="bench", autostart=False)
        small = client.register(_desc(4096))
        prefix = _keys(64, "lookup")
        client.commit(client.reserve(small, prefix))
        busy.extend(subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(os.cpu_count() or 1))
        stop = threading.Event()
        committed = [0]
        committer = threading.Thread(target=_commit_loop, args=(pool_dir, stop, committed))
        if nice is not None:
            committer.start()
        time.sleep(1.0)
        times = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            started = time.perf_counter()
            client.lookup(small, prefix)
            times.append((time.perf_counter() - started) * 1e3)
            time.sleep(LOOKUP_EVERY_S)
        num_files = sum(1 for _ in storage.rglob("*.kv")) - len(prefix)
        stop.set()
        if nice is not None:
            committer.join()
        client.close()
    times.sort()
    return {
        "nice": nice,
        "lookups": len(times),
        "p50_ms": statistics.median(times),
        "p90_ms": times[int(len(times) * 0.9)],
        "p99_ms": times[int(len(times) * 0.99)],
        "max_ms": times[-1],
        "committed": committed[0],
        "written": max(0, num_files),
    }


def _kill_all(processes: list[subprocess.Popen]) -> None:
    for proc in processes:
        proc.kill()
        proc.wait()


def _commit_loop(pool_dir: Path, stop: threading.Event, committed: list[int]) -> None:
    client = Client(pool_dir, kind="writer", autostart=False)
    ns = client.register(_desc(ENTRY))
    src = np.random.default_rng(0).integers(0, 255, ENTRY, dtype=np.uint8)
    for batch in range(10**9):
        if stop.is_set():
            break
        keys = _keys(BATCH, f"w{batch}-")
        reservation = client.reserve(ns, keys)
        pool = np.frombuffer(reservation.region.buf, dtype=np.uint8)
        for offset in reservation.offsets:
            if offset is not None:
                np.copyto(pool[offset : offset + ENTRY], src)
        committed[0] += client.commit(reservation)
        time.sleep(BATCH_EVERY_S)
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nice", default="0,10,19", help="HPKV_WRITE_NICE values, comma-separated")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument(
        "--storage-dir", type=Path, default=Path.cwd(), help="parent of the storage temporaries (on disk, not /dev/shm)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [run_one(None, args.seconds, args.storage_dir)]
    rows += [run_one(int(n), args.seconds, args.storage_dir) for n in args.nice.split(",")]
    base = rows[0]["p99_ms"]
    for row in rows:
        row["p99_vs_baseline"] = row["p99_ms"] / base
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=2))
        return
    print(
        f"lookups of 64 keys every {LOOKUP_EVERY_S * 1e3:.0f} ms for {args.seconds:.0f} s, "
        f"{os.cpu_count()} busy processes; commits of {BATCH} x 256 KiB every {BATCH_EVERY_S * 1e3:.0f} ms"
    )
    print(
        f"{'HPKV_WRITE_NICE':>16} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7} {'p99/base':>9} "
        f"{'written / committed':>20}"
    )
    for row in rows:
        label = "(no writes)" if row["nice"] is None else str(row["nice"])
        print(
            f"{label:>16} {row['p50_ms']:7.2f} {row['p90_ms']:7.2f} {row['p99_ms']:7.2f} {row['max_ms']:7.1f} "
            f"{row['p99_vs_baseline']:9.2f} {row['written']:>9} / {row['committed']:<9}"
        )


if __name__ == "__main__":
    main()
