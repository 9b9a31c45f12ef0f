"""Benchmark: what a storage device that falls behind costs the DRAM tier, with the store's limit
on the write backlog (half the pool pinned at most; the rest deferred, unpinned) against no limit
(what the store did before commit 3c60186: every committed entry pinned until written), on the same
requests in the same run.

Two real stores (`TieredStore`, pools on /dev/shm, a storage directory, write-through processes)
get the same seeded requests, one after the other: the Zipf documents of
`bench/prefix_eviction.py` (the leading hits are leased and released, the rest reserved and
committed). A slow device is made of the real write-through processes: they are stopped
(`SIGSTOP`) for `--stalled` of every 100 ms and go on (`SIGCONT`) for the rest; 1.0 is a device
that stopped answering for the whole run (an NFS server that hangs). After the requests the
writers go on and the store writes what it holds (`flush`); the entries on storage are counted.

    .venv/bin/python -m bench.stalled_storage [--requests 3000] [--stalled 1.0] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.harness import configs
from bench.harness.keys import keys, namespace
from bench.prefix_eviction import ENTRY, workload_arguments, zipf_requests  # the same documents
from hpkv.config import PoolConfig
from hpkv.store import StorePolicy, TieredStore, create_store

PERIOD_S = 0.1
WARM = keys(4, "warm-")


UNLIMITED_BACKLOG = StorePolicy(backlog_share=math.inf)  # the baseline: every committed entry pinned until written


class Throttle:
    """Stops the writer processes for `share` of every PERIOD_S, until `stop`."""

    def __init__(self, pids: list[int], share: float) -> None:
        self.pids, self.share = pids, share
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._signal(signal.SIGSTOP)
        if self.share < 1.0:
            self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(PERIOD_S * self.share):
            self._signal(signal.SIGCONT)
            if self._done.wait(PERIOD_S * (1.0 - self.share)):
                return
            self._signal(signal.SIGSTOP)

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        for pid in self.pids:
            os.kill(pid, signum)


def serve(store: TieredStore, ns: str, doc: list) -> tuple[int, int]:
    """One request as an engine makes it; (blocks that hit in DRAM, blocks that hit in all)."""
    hit = store.lookup(ns, doc)
    if hit.num_hit:
        lease = store.lease(ns, doc[: hit.num_hit])
        lease.wait(timeout=30)
        store.release(lease.id)
    rest = doc[hit.num_hit :]
    if rest:
        store.reserve(ns, rest)
        store.commit(ns, rest)
    return hit.num_dram, hit.num_hit


def run(args: argparse.Namespace) -> dict:
    entries = args.pool_bytes // ENTRY
    lengths, docs, picks = zipf_requests(args, entries)
    # Drift: the popularity ranking turns over the documents `--drift` times during the run, as
    # new conversations and documents arrive and old ones fade.
    picks = (picks + (np.arange(args.requests) * args.drift * len(docs) // args.requests).astype(int)) % len(docs)
    desc = namespace("stalled-storage", ENTRY)
    asked = sum(lengths[d] for d in picks)
    out: dict = {
        "pool_entries": entries,
        "documents": len(docs),
        "all_blocks": sum(lengths),
        "requests": args.requests,
        "stalled": args.stalled,
        "drift": args.drift,
        "stores": {},
    }
    for name, policy in (("HPKV (half the pool at most)", StorePolicy()), ("no limit (all pinned)", UNLIMITED_BACKLOG)):
        with (
            tempfile.TemporaryDirectory(dir=args.pool_dir, prefix="hpkv-bench-") as pool_dir,
            tempfile.TemporaryDirectory(dir=args.storage_dir, prefix="hpkv-bench-") as storage_dir,
        ):
            storage = configs.storage(Path(storage_dir))
            store = create_store(PoolConfig(dir=Path(pool_dir), size_bytes=args.pool_bytes), storage, policy=policy)
            try:
                ns = store.register(desc)
                serve(store, ns, WARM)  # starts the writer processes
                store.flush(timeout=30)
                throttle = Throttle(store.writers.pids(), args.stalled)
                throttle.start()
                try:
                    started = time.perf_counter()
                    hits = [serve(store, ns, docs[d]) for d in picks]
                    elapsed = time.perf_counter() - started
                    stats = store.stats()
                finally:
                    throttle.stop()
                store.flush()
                on_storage = store.stats().storage.num_entries - len(WARM)
                lost = store.counters.write_through_lost
            finally:
                store.close()
        out["stores"][name] = {
            "dram_hit_rate": sum(h[0] for h in hits) / asked,
            "hit_rate": sum(h[1] for h in hits) / asked,
            "no_hit": sum(h[1] == 0 for h in hits) / args.requests,
            "saves_skipped": stats.dram.reserve_failures,
            "backlog_entries": stats.write_backlog.entries,
            "deferred": stats.write_backlog.deferred,
            "written_after": on_storage,
            "lost": lost,
            "seconds": round(elapsed, 2),
        }
    new, old = (out["stores"][k]["hit_rate"] for k in out["stores"])
    out["ratio"] = new / old if old else float("inf")
    return out


def main(argv: list[str] | None = None) -> int:
    p = workload_arguments(__doc__.split("\n\n")[0], requests=3000, working_set=4.0)
    p.add_argument("--stalled", type=float, default=1.0, help="share of the time the writers are stopped")
    p.add_argument(
        "--drift",
        type=float,
        default=1.0,
        help="times the popular documents change over the run (0: the same ones throughout)",
    )
    p.add_argument("--storage-dir", default=".", help="parent of the storage temporaries")
    args = p.parse_args(argv)
    if not 0.0 <= args.stalled <= 1.0:
        p.error("--stalled is a share of the time, from 0 to 1")
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"pool of {out['pool_entries']} entries; {out['documents']} documents "
        f"({out['all_blocks'] / out['pool_entries']:.1f}x the pool), {out['requests']} requests, popularity "
        f"turning over {out['drift']:g} times; writers stopped {out['stalled']:.0%} of the time"
    )
    print(
        f"{'write backlog':30} {'hit rate':>9} {'DRAM':>7} {'no hit':>7} {'saves skipped':>14} "
        f"{'pinned':>7} {'deferred':>9} {'on storage':>11} {'lost':>6}"
    )
    for name, r in out["stores"].items():
        print(
            f"{name:30} {r['hit_rate']:>8.1%} {r['dram_hit_rate']:>7.1%} {r['no_hit']:>7.1%} "
            f"{r['saves_skipped']:>14} {r['backlog_entries']:>7} {r['deferred']:>9} {r['written_after']:>11} "
            f"{r['lost']:>6}"
        )
    print(f"hit rate, HPKV / no limit: {out['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
