"""Benchmark of the HPKV Server's control path and of copies through its pool by a client.

Starts a real server process, then, from this (client) process:
- round trip of a 4,096-key prefix lookup (32-byte keys, all hits in DRAM), median and p99;
- reserve + commit of 64 entries (no copy), median and p99;
- DRAM read through the pool at 1 MiB entries: lease + wait + copy out + release, in GB/s,
  against a plain numpy copy of the same bytes in the same process (the memory limit).
Targets: lookup <= 2 ms, reserve+commit <= 2 ms, pool read >= 0.7x the copy limit.

    .venv/bin/python bench/server.py [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hpkv.keys import NamespaceDesc, make_key
from hpkv.server.autostart import answers
from hpkv.server.client import Client
from hpkv.server.protocol import SOCKET_NAME

ENTRY = 1 << 20
NUM_READ = 128  # 128 MiB per round


def _keys(n: int, tag: str) -> list[bytes]:
    return [make_key(hashlib.sha256(f"{tag}{i}".encode()).digest()) for i in range(n)]


def _desc(entry_bytes: int) -> NamespaceDesc:
    return NamespaceDesc(engine="bench", model="server", dtype="bfloat16", layout="blocks", block_size=32,
                         num_layers=1, entry_bytes=entry_bytes)


def _times(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def _ms(times: list[float]) -> tuple[float, float]:
    times = sorted(times)
    return statistics.median(times) * 1e3, times[int(len(times) * 0.99) - 1] * 1e3


def run() -> dict:
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-bench-server-", dir="/dev/shm"))
    storage = Path(tempfile.mkdtemp(prefix="hpkv-bench-server-"))
    env = {**os.environ, "HPKV_SHARE_MEM_FILE_PATH": str(pool_dir), "HPKV_KV_STORAGE_PATH": str(storage),
           "HPKV_KV_MEM_POOL_SIZE": "1g", "HPKV_KV_STORAGE_ENABLE": "0",
           "HPKV_CONFIG_FILE_PATH": str(pool_dir / "none.ini"), "HPKV_LOG_LEVEL": "warning"}
    server = subprocess.Popen([sys.executable, "-m", "hpkv.server.daemon"], env=env)
    try:
        deadline = time.monotonic() + 30
        while not answers(pool_dir / SOCKET_NAME) and time.monotonic() < deadline:
            time.sleep(0.05)
        return _measure(Client(pool_dir, kind="bench", autostart=False))
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(pool_dir, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)


def _measure(client: Client) -> dict:
    small = client.register(_desc(4096))
    prefix = _keys(4096, "lookup")
    reservation = client.reserve(small, prefix)
    assert None not in reservation.offsets
    client.commit(small, prefix)
    assert client.lookup(small, prefix).num_hit == 4096
    lookup = _ms(_times(lambda: client.lookup(small, prefix), 300))

    counter = iter(range(10**9))

    def reserve_commit() -> None:
        batch = _keys(64, f"rc{next(counter)}-")
        client.reserve(small, batch)
        client.commit(small, batch)

    reserve_commit_ms = _ms(_times(reserve_commit, 200))

    big = client.register(_desc(ENTRY))
    keys = _keys(NUM_READ, "read")
    src = np.random.default_rng(0).integers(0, 255, NUM_READ * ENTRY, dtype=np.uint8)
    reservation = client.reserve(big, keys)
    pool = np.frombuffer(reservation.region.buf, dtype=np.uint8)
    for i, offset in enumerate(reservation.offsets):
        np.copyto(pool[offset : offset + ENTRY], src[i * ENTRY : (i + 1) * ENTRY])
    client.commit(big, keys)
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
        pool_times += _times(read_pool, 1)
        plain_times += _times(read_plain, 1)
    read_pool()
    assert np.array_equal(dst, src)
    pool_gbps = NUM_READ * ENTRY / min(pool_times[1:]) / 1e9
    plain_gbps = NUM_READ * ENTRY / min(plain_times[1:]) / 1e9
    client.close()
    return {
        "lookup_4096_ms": {"median": lookup[0], "p99": lookup[1], "target": 2.0},
        "reserve_commit_64_ms": {"median": reserve_commit_ms[0], "p99": reserve_commit_ms[1], "target": 2.0},
        "dram_read_1mib_gbps": {"pool": pool_gbps, "copy_limit": plain_gbps, "ratio": pool_gbps / plain_gbps,
                                "target": 0.7},
        "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    result = run()
    if parser.parse_args().json:
        print(json.dumps(result, indent=2))
        return
    lk, rc, rd = result["lookup_4096_ms"], result["reserve_commit_64_ms"], result["dram_read_1mib_gbps"]
    verdict = lambda ok: "PASS" if ok else "MISS"  # noqa: E731
    print(f"HPKV server benchmark ({result['cpus']} CPUs, load {result['load_avg_1m']})")
    print(f"  lookup of a 4,096-key prefix, round trip: median {lk['median']:.3f} ms, p99 {lk['p99']:.3f} ms"
          f"  (target <= 2 ms: {verdict(lk['median'] <= 2)})")
    print(f"  reserve + commit of 64 entries:           median {rc['median']:.3f} ms, p99 {rc['p99']:.3f} ms"
          f"  (target <= 2 ms: {verdict(rc['median'] <= 2)})")
    print(f"  DRAM read through the pool, 1 MiB entries: {rd['pool']:.2f} GB/s vs plain copy {rd['copy_limit']:.2f}"
          f" GB/s = {rd['ratio']:.2f}x  (target >= 0.7x: {verdict(rd['ratio'] >= 0.7)})")


if __name__ == "__main__":
    main()
