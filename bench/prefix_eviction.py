"""Benchmark: DRAM hit rate of long prefixes in a pool smaller than their working set, with the
store's eviction order (a prefix's last entries leave first) against plain LRU in prefix order
(what the store did before Nov 30), on the same requests in the same run.

An entry is of use only behind every entry before it in its prefix: a lookup stops at the first
miss. With plain LRU, the entries of a prefix used together reach the LRU in prefix order, so
the first of them is the oldest and leaves first, and the rest of the prefix stays in the pool
useless. The store unpins and commits them last first (`TieredStore.release`), as vLLM frees its
own blocks, so eviction shortens a prefix from its end.

Two real stores (`TieredStore`, pools on /dev/shm, storage tier off so that every hit is a DRAM
hit) get the same seeded requests, one after the other. Each request is one document: the
leading DRAM hits are leased (copied, in an engine) and released; the entries after the first
miss are reserved and committed (computed and saved, in an engine; present ones are skipped).
Documents are drawn from a Zipf distribution, so some come back often and some rarely; all of
them together are `--working-set` times the pool.

    .venv/bin/python -m bench.prefix_eviction [--requests 4000] [--working-set 1.5] [--doc-blocks 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import configs
from bench.harness.keys import keys, namespace
from hpkv.config import PoolConfig
from hpkv.store import PrefixOrder, StorePolicy, TieredStore, create_store

ENTRY = 16 << 10


PREFIX_ORDER = StorePolicy(order=PrefixOrder.FIRST_FIRST)  # the baseline: commits and releases first first


def documents(lengths: list[int]) -> list[list[bytes]]:
    return [keys(n, f"doc-{d}-block-") for d, n in enumerate(lengths)]


def serve(store: TieredStore, ns: str, doc: list[bytes]) -> int:
    """One request as an engine makes it; returns the blocks that hit in DRAM."""
    num_hit = store.lookup(ns, doc).num_dram  # storage is off: every hit is a DRAM hit
    if num_hit:
        lease = store.lease(ns, doc[:num_hit])
        lease.wait(timeout=10)
        store.release(lease.id)
    rest = doc[num_hit:]
    if rest:
        store.reserve(ns, rest)
        store.commit(ns, rest)
    return num_hit


def zipf_requests(args: argparse.Namespace, entries: int) -> tuple[list[int], list[list[bytes]], np.ndarray]:
    """(document lengths, their keys, the document of each request): documents of 1/4 to 7/4 of
    --doc-blocks that together take --working-set pools of `entries`, drawn by Zipf popularity."""
    rng = np.random.default_rng(args.seed)
    lengths: list[int] = []
    while sum(lengths) < args.working_set * entries:
        lengths.append(int(rng.integers(args.doc_blocks // 4, args.doc_blocks * 7 // 4 + 1)))
    weights = 1.0 / np.arange(1, len(lengths) + 1) ** args.zipf
    return lengths, documents(lengths), rng.choice(len(lengths), size=args.requests, p=weights / weights.sum())


def run(args: argparse.Namespace) -> dict:
    entries = args.pool_bytes // ENTRY
    lengths, docs, picks = zipf_requests(args, entries)
    num_docs = len(lengths)
    storage_off = configs.storage_off()
    desc = namespace("prefix-eviction", ENTRY)
    total = sum(lengths)
    out: dict = {
        "pool_entries": entries,
        "documents": num_docs,
        "doc_blocks": args.doc_blocks,
        "all_blocks": total,
        "requests": args.requests,
        "zipf": args.zipf,
        "stores": {},
    }
    for name, policy in (("HPKV (last entries first)", StorePolicy()), ("plain LRU (prefix order)", PREFIX_ORDER)):
        with tempfile.TemporaryDirectory(dir=args.pool_dir, prefix="hpkv-bench-") as pool_dir:
            store = create_store(PoolConfig(dir=Path(pool_dir), size_bytes=args.pool_bytes), storage_off, policy=policy)
            try:
                ns = store.register(desc)
                started = time.perf_counter()
                hits = [serve(store, ns, docs[d]) for d in picks]
                elapsed = time.perf_counter() - started
                evictions = store.stats().dram.evictions
            finally:
                store.close()
        out["stores"][name] = {
            "hit_blocks": int(sum(hits)),
            "hit_rate": sum(hits) / sum(lengths[d] for d in picks),
            "full_hits": sum(h == lengths[d] for h, d in zip(hits, picks)) / args.requests,
            "no_hit": sum(h == 0 for h in hits) / args.requests,
            "evictions": evictions,
            "seconds": round(elapsed, 2),
        }
    new, old = (out["stores"][k]["hit_rate"] for k in out["stores"])
    out["ratio"] = new / old if old else float("inf")
    return out


def workload_arguments(description: str, requests: int, working_set: float) -> argparse.ArgumentParser:
    """The options of the Zipf document workload (`zipf_requests`), shared by the benchmarks that use it."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--requests", type=int, default=requests)
    p.add_argument("--pool-bytes", type=int, default=32 << 20, help="each store's pool (entries of 16 KiB)")
    p.add_argument(
        "--doc-blocks",
        type=int,
        default=256,
        help="mean entries per document (its prefix; 256: 8K tokens in blocks of 32)",
    )
    p.add_argument("--working-set", type=float, default=working_set, help="all documents, in pools")
    p.add_argument("--zipf", type=float, default=1.0, help="exponent of the documents' popularity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pool-dir", default="/dev/shm", help="parent of the pool temporaries (tmpfs)")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = workload_arguments(__doc__.split("\n\n")[0], requests=4000, working_set=1.5).parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"pool of {out['pool_entries']} entries; {out['documents']} documents of {out['doc_blocks'] // 4} to "
        f"{out['doc_blocks'] * 7 // 4} entries ({out['all_blocks'] / out['pool_entries']:.1f}x the pool), "
        f"{out['requests']} requests, Zipf {out['zipf']}"
    )
    print(f"{'eviction order':28} {'DRAM hit rate':>14} {'full hits':>10} {'no hit':>8} {'evictions':>10}")
    for name, r in out["stores"].items():
        print(f"{name:28} {r['hit_rate']:>13.1%} {r['full_hits']:>10.1%} {r['no_hit']:>8.1%} {r['evictions']:>10}")
    print(f"hit rate, HPKV / plain LRU: {out['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
