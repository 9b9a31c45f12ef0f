"""Benchmark: how long a lookup waits behind another engine's reserve, in a pool shared by two
entry sizes with one pinned entry in every slab (row 8 of issue 18), with the store's way of
finding room against the walk over every older entry that it replaced, in the same run.

The pool is filled with small entries (namespace A, older) in half its slabs and large ones
(namespace B) in the other half; one entry of every slab is leased and kept. Then, over and over,
one thread reserves 128 new keys of B (each must find room: no slab of A may move, so each
evicts B's own oldest entry) and commits them, while this thread times a 16-key lookup in A
started just after. The baseline is the same lookup with no reserve running, in the same store.
The figures are ratios to that baseline (a lookup waits for the store's lock: how long the
reserve holds it is what this measures).

    .venv/bin/python -m bench.reserve_contention [--pool-bytes 64m] [--rounds 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.harness import configs
from bench.harness.keys import keys as _keys
from bench.harness.keys import namespace
from hpkv.config import PoolConfig, parse_size
from hpkv.keys import NamespaceDesc
from hpkv.pool.room import WalkOldest
from hpkv.store import StorePolicy, TieredStore, create_store

SMALL, LARGE = 4 << 10, 64 << 10
NUM_RESERVE = 128


WALK = StorePolicy(room=WalkOldest())  # the way room was found before: a walk over every older entry


def _desc(entry_bytes: int) -> NamespaceDesc:
    return namespace(f"contention-{entry_bytes}", entry_bytes, block_size=16)


def _fill(store: TieredStore) -> tuple[str, str, list[bytes]]:
    """Half the slabs of A, half of B, one entry of each slab leased (and kept)."""
    ns_a, ns_b = store.register(_desc(SMALL)), store.register(_desc(LARGE))
    alloc = store.dram.alloc
    half = alloc.num_slabs // 2
    a = _keys(half * (alloc.slab_bytes // SMALL), "a")
    b = _keys((alloc.num_slabs - half) * (alloc.slab_bytes // LARGE), "b")
    for ns, ks in ((ns_a, a), (ns_b, b)):
        for i in range(0, len(ks), 4096):
            assert None not in store.reserve(ns, ks[i : i + 4096])
            store.commit(ns, ks[i : i + 4096])
    assert alloc.num_free_slabs == 0
    first_of_slab: dict[int, tuple[str, bytes]] = {}
    for ns, ks in ((ns_a, a), (ns_b, b)):
        for key in ks:
            first_of_slab.setdefault(alloc.slab_of(store.dram.get(ns, key).offset), (ns, key))
    for ns, key in first_of_slab.values():
        assert len(store.lease(ns, [key], owner=99).entries) == 1
    return ns_a, ns_b, a


def _lookup_ms(store: TieredStore, ns: str, keys: list[bytes]) -> float:
    started = time.perf_counter()
    store.lookup(ns, keys)
    return (time.perf_counter() - started) * 1e3


def measure(policy: StorePolicy, pool_bytes: int, rounds: int, pool_dir: str) -> dict:
    storage_off = configs.storage_off()
    with tempfile.TemporaryDirectory(dir=pool_dir, prefix="hpkv-bench-") as directory:
        store = create_store(PoolConfig(dir=Path(directory), size_bytes=pool_bytes), storage_off, policy=policy)
        try:
            ns_a, ns_b, a = _fill(store)
            probe = a[:16]
            baseline = [_lookup_ms(store, ns_a, probe) for _ in range(200)]
            waits, reserves = [], []
            for r in range(rounds):
                keys = _keys(NUM_RESERVE, f"new{r}-")
                started = threading.Event()

                def reserve(keys: list[bytes], started: threading.Event) -> None:
                    started.set()
                    t0 = time.perf_counter()
                    store.reserve(ns_b, keys, owner=1)
                    reserves.append((time.perf_counter() - t0) * 1e3)

                thread = threading.Thread(target=reserve, args=(keys, started))
                thread.start()
                started.wait()
                time.sleep(0.0005)  # the reserve has the lock by now
                waits.append(_lookup_ms(store, ns_a, probe))
                thread.join()
                store.commit(ns_b, keys, owner=1)  # the pool stays full: the next round must find room too
            entries = store.stats().dram.num_entries
        finally:
            store.close()
    base = statistics.median(baseline)
    return {
        "entries": entries,
        "baseline_lookup_ms": round(base, 4),
        "reserve_128_ms": round(statistics.median(reserves), 3),
        "lookup_wait_ms": {"median": round(statistics.median(waits), 3), "max": round(max(waits), 3)},
        "lookup_wait_ratio": {"median": round(statistics.median(waits) / base, 1), "max": round(max(waits) / base, 1)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool-bytes", type=parse_size, default=parse_size("64m"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--pool-dir", default="/dev/shm", help="parent of the pool temporaries (tmpfs)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = {
        "pool_bytes": args.pool_bytes,
        "reserve_keys": NUM_RESERVE,
        "walk (before)": measure(WALK, args.pool_bytes, args.rounds, args.pool_dir),
        "store (now)": measure(StorePolicy(), args.pool_bytes, args.rounds, args.pool_dir),
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"pool {args.pool_bytes >> 20} MiB, two entry sizes, one pinned entry in every slab; "
        f"a {NUM_RESERVE}-key reserve of the large size, a 16-key lookup of the small one behind it"
    )
    for name in ("walk (before)", "store (now)"):
        m = out[name]
        print(
            f"  {name:14s} {m['entries']:7d} entries  reserve {m['reserve_128_ms']:9.3f} ms  lookup waits "
            f"{m['lookup_wait_ms']['median']:9.3f} ms median, {m['lookup_wait_ms']['max']:9.3f} ms max  "
            f"({m['lookup_wait_ratio']['median']:.1f}x / {m['lookup_wait_ratio']['max']:.1f}x its baseline of "
            f"{m['baseline_lookup_ms']:.4f} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
