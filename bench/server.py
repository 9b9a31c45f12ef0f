"""Benchmark of the HPKV Server's control path and of copies through its pool by a client.

Starts a real server process, then, from this (client) process:
- round trip of a 4,096-key prefix lookup (32-byte keys, all hits in DRAM), median and p99;
- reserve + commit of 64 entries (no copy), median and p99;
- DRAM read through the pool at 1 MiB entries: lease + wait + copy out + release, in GB/s,
  against a plain numpy copy of the same bytes in the same process (the memory limit).
Targets: lookup <= 2 ms, reserve+commit <= 2 ms, pool read >= 0.7x the copy limit.

    .venv/bin/python -m bench.server [--json]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from bench.harness.keys import keys as _keys
from bench.harness.keys import namespace
from bench.harness.report import median_p99_ms, timed, verdict
from bench.harness.server import temporary_server
from hpkv.keys import NamespaceDesc
from hpkv.server.client import Client

ENTRY = 1 << 20
NUM_READ = 128  # 128 MiB per round


def _desc(entry_bytes: int) -> NamespaceDesc:
    return namespace("server", entry_bytes, dtype="bfloat16", num_layers=1)


def run() -> dict:
    with temporary_server("hpkv-bench-server-", HPKV_KV_STORAGE_ENABLE="0") as (pool_dir, _):
        return _measure(Client(pool_dir, kind="bench", autostart=False))


def _measure(client: Client) -> dict:
    small = client.register(_desc(4096))
    prefix = _keys(4096, "lookup")
    reservation = client.reserve(small, prefix)
    assert None not in reservation.offsets
    client.commit(reservation)
    assert client.lookup(small, prefix).num_hit == 4096
    lookup = median_p99_ms(timed(lambda: client.lookup(small, prefix), 300))

    counter = iter(range(10**9))

    def reserve_commit() -> None:
        batch = _keys(64, f"rc{next(counter)}-")
        client.commit(client.reserve(small, batch))

    reserve_commit_ms = median_p99_ms(timed(reserve_commit, 200))

    big = client.register(_desc(ENTRY))
    keys = _keys(NUM_READ, "read")
    src = np.random.default_rng(0).integers(0, 255, NUM_READ * ENTRY, dtype=np.uint8)
    reservation = client.reserve(big, keys)
    pool = np.frombuffer(reservation.region.buf, dtype=np.uint8)
    for i, offset in enumerate(reservation.offsets):
        np.copyto(pool[offset : offset + ENTRY], src[i * ENTRY : (i + 1) * ENTRY])
    client.commit(reservation)
    dst = np.empty_like(src)

    def read_pool() -> None:
        lease = client.lease(big, keys)
        num_ready = client.wait(lease)
        for i, offset in enumerate(lease.offsets[:num_ready]):
            np.copyto(dst[i * ENTRY : (i + 1) * ENTRY], pool[offset : offset + ENTRY])
        client.release(lease)

    def read_plain() -> None:
        for i in range(NUM_READ):
            np.copyto(dst[i * ENTRY : (i + 1) * ENTRY], src[i * ENTRY : (i + 1) * ENTRY])

    pool_times, plain_times = [], []
    for _ in range(10):  # alternate, so background load hits both alike; best round counts
        pool_times += timed(read_pool, 1)
        plain_times += timed(read_plain, 1)
    read_pool()
    assert np.array_equal(dst, src)
    pool_gbps = NUM_READ * ENTRY / min(pool_times[1:]) / 1e9
    plain_gbps = NUM_READ * ENTRY / min(plain_times[1:]) / 1e9
    client.close()
    return {
        "lookup_4096_ms": {"median": lookup[0], "p99": lookup[1], "target": 2.0},
        "reserve_commit_64_ms": {"median": reserve_commit_ms[0], "p99": reserve_commit_ms[1], "target": 2.0},
        "dram_read_1mib_gbps": {
            "pool": pool_gbps,
            "copy_limit": plain_gbps,
            "ratio": pool_gbps / plain_gbps,
            "target": 0.7,
        },
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()  # before the run, so that --help runs nothing
    result = run()
    if args.json:
        print(json.dumps(result, indent=2))
        return
    lk, rc, rd = result["lookup_4096_ms"], result["reserve_commit_64_ms"], result["dram_read_1mib_gbps"]
    print(f"HPKV server benchmark ({result['cpus']} CPUs, load {result['load_avg_1m']})")
    print(
        f"  lookup of a 4,096-key prefix, round trip: median {lk['median']:.3f} ms, p99 {lk['p99']:.3f} ms"
        f"  (target <= 2 ms: {verdict(lk['median'] <= 2)})"
    )
    print(
        f"  reserve + commit of 64 entries:           median {rc['median']:.3f} ms, p99 {rc['p99']:.3f} ms"
        f"  (target <= 2 ms: {verdict(rc['median'] <= 2)})"
    )
    print(
        f"  DRAM read through the pool, 1 MiB entries: {rd['pool']:.2f} GB/s vs plain copy {rd['copy_limit']:.2f}"
        f" GB/s = {rd['ratio']:.2f}x  (target >= 0.7x: {verdict(rd['ratio'] >= 0.7)})"
    )


if __name__ == "__main__":
    main()
