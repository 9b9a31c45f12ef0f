"""Benchmark: the storage tier through the page cache (the default) against direct I/O
(`HPKV_KV_STORAGE_DIRECT_IO=on`), what each costs the CPU, in the same run.

A real store (`create_store`: the pool on /dev/shm, the storage tier on disk, write-throughs
in writer processes) gets rounds of N entries of 256 KiB (default 384: 96 MiB, one no-reuse
round of `bench/peers.py` on the BENCH model). The two settings alternate, round by round, each
in a store of its own. Per round:
- **write-through**: commit, then wait for the files (`flush`); then `os.sync()`, which waits for
  whatever writeback the round left to the kernel. CPU seconds of the store's process and of its
  writer processes, and of the whole machine (kernel writeback included) from the commit to the
  end of the sync.
- **storage hit**: the DRAM copies are dropped and the same keys are leased, so the store
  promotes them from storage on its I/O threads: right after the write ("hot": through the page
  cache the write left behind, where there is one) and after `POSIX_FADV_DONTNEED` on every file
  ("cold": from the device either way).

Medians over the rounds; ratios direct / page cache.

    .venv/bin/python -m bench.direct_io [--rounds 6] [--entries 384] [--storage-dir DIR] [--json]
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
from pathlib import Path

import numpy as np
import psutil

from bench.harness import configs
from bench.harness.keys import keys as make_keys
from bench.harness.keys import namespace
from hpkv.store import TieredStore, create_store

ENTRY = 256 << 10
MODES = ("page cache", "direct")


def machine_cpu() -> float:
    t = psutil.cpu_times()
    return t.user + t.system + t.nice + t.irq + t.softirq


def writers_cpu(store: TieredStore) -> float:
    total = 0.0
    for pid in store.writers.pids() if store.writers else []:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def own_cpu() -> float:
    t = os.times()
    return t.user + t.system


class Side:
    """One store and its namespace, with one setting."""

    def __init__(self, direct: bool, storage_parent: Path, entries: int) -> None:
        self.direct = direct
        self.pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-bench-dio-", dir="/dev/shm"))
        self.storage_dir = Path(tempfile.mkdtemp(prefix="hpkv-bench-dio-", dir=storage_parent))
        pool = configs.pool(self.pool_dir, 2 * entries * ENTRY + (64 << 20))
        storage = configs.storage(self.storage_dir, io_threads=8, direct_io=direct)
        self.store = create_store(pool, storage)
        if direct and not self.store.storage.reader.direct:
            raise SystemExit(f"{storage_parent} does not take O_DIRECT; pick another --storage-dir")
        self.ns = self.store.register(namespace("direct-io", ENTRY, dtype="bfloat16", num_layers=28))
        self.src = np.random.default_rng(0).integers(0, 255, ENTRY, dtype=np.uint8)

    def round(self, index: int, entries: int) -> dict[str, float]:
        store = self.store
        keys = make_keys(entries, f"{self.direct}-{index}-")
        pool = np.frombuffer(store.region.buf, dtype=np.uint8)
        for offset in store.reserve(self.ns, keys):
            np.copyto(pool[offset : offset + ENTRY], self.src)
        os.sync()
        m0, c0, w0, t0 = machine_cpu(), own_cpu(), writers_cpu(store), time.perf_counter()
        store.commit(self.ns, keys)
        if not store.flush(timeout=300):
            raise SystemExit("the write-through did not finish in 300 s")
        t1 = time.perf_counter()
        c1, w1 = own_cpu(), writers_cpu(store)
        os.sync()
        t2, m2 = time.perf_counter(), machine_cpu()
        row = {"write_s": t1 - t0, "sync_s": t2 - t1, "store_cpu_s": (c1 - c0) + (w1 - w0), "machine_cpu_s": m2 - m0}
        row["hot_read_s"], row["hot_read_cpu_s"] = self.promote(keys)
        self.drop_page_cache(keys)
        row["cold_read_s"], row["cold_read_cpu_s"] = self.promote(keys)
        store.clear(dram=True, storage=True, ns=self.ns)
        return row

    def promote(self, keys: list[bytes]) -> tuple[float, float]:
        """Drop the DRAM copies, lease every key (a promotion from storage), wait for them."""
        store = self.store
        store.clear(dram=True, ns=self.ns)
        m0, t0 = machine_cpu(), time.perf_counter()
        lease = store.lease(self.ns, keys)
        try:
            ready = lease.wait(timeout=120)
        finally:
            store.release(lease.id)
        elapsed, cpu = time.perf_counter() - t0, machine_cpu() - m0
        if ready != len(keys):
            raise SystemExit(f"only {ready} of {len(keys)} entries came back from storage")
        return elapsed, cpu

    def drop_page_cache(self, keys: list[bytes]) -> None:
        for key in keys:
            fd = os.open(self.store.storage.paths.path_of(self.ns, key), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        self.store.close()
        shutil.rmtree(self.pool_dir, ignore_errors=True)
        shutil.rmtree(self.storage_dir, ignore_errors=True)


def run(rounds: int, entries: int, storage_parent: Path) -> dict:
    sides = {mode: Side(mode == "direct", storage_parent, entries) for mode in MODES}
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    try:
        for index in range(rounds + 1):  # round 0 is a warm-up: writers start, directories appear
            for mode in MODES if index % 2 == 0 else MODES[::-1]:
                row = sides[mode].round(index, entries)
                if index:
                    rows[mode].append(row)
    finally:
        for side in sides.values():
            side.close()
    medians = {mode: {k: statistics.median(r[k] for r in rows[mode]) for k in rows[mode][0]} for mode in MODES}
    return {
        "entries": entries,
        "entry_bytes": ENTRY,
        "rounds": rounds,
        "storage_parent": str(storage_parent),
        "cpus": os.cpu_count(),
        "rows": rows,
        "medians": medians,
        "ratios": {
            k: medians["direct"][k] / medians["page cache"][k]
            for k in medians["direct"]
            if medians["page cache"][k] > 0
        },
    }


def print_table(result: dict) -> None:
    mib = result["entries"] * result["entry_bytes"] / 2**20
    print(
        f"{result['entries']} entries of {result['entry_bytes'] >> 10} KiB ({mib:.0f} MiB) per round, "
        f"{result['rounds']} rounds per setting, alternating; storage under {result['storage_parent']}; "
        f"{result['cpus']} CPUs; medians"
    )
    labels = [
        ("write_s", "write-through (until the files are there)", "s"),
        ("sync_s", "then os.sync (writeback left to the kernel)", "s"),
        ("store_cpu_s", "CPU: store process + writer processes", "s"),
        ("machine_cpu_s", "CPU: whole machine, commit to end of sync", "s"),
        ("hot_read_s", "storage hit right after the write", "s"),
        ("hot_read_cpu_s", "  its CPU, whole machine", "s"),
        ("cold_read_s", "storage hit, page cache dropped", "s"),
        ("cold_read_cpu_s", "  its CPU, whole machine", "s"),
    ]
    print(f"{'':46} {'page cache':>11} {'direct':>9} {'direct/page cache':>18}")
    for key, label, _ in labels:
        a, b = result["medians"]["page cache"][key], result["medians"]["direct"][key]
        ratio = f"{b / a:.2f}" if a > 0 else "-"
        print(f"{label:46} {a * 1e3:9.1f}ms {b * 1e3:7.1f}ms {ratio:>18}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--entries", type=int, default=384)
    parser.add_argument(
        "--storage-dir", type=Path, default=Path.cwd(), help="parent of the storage temporaries (on disk, not /dev/shm)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.rounds, args.entries, args.storage_dir)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print_table(result)


if __name__ == "__main__":
    main()
