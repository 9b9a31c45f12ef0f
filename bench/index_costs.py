"""Costs that grow with work: index memory per million entries, lookup with 10 million storage
entries indexed, and the write-through's CPU per GiB against the floor of the same work.

- DRAM index: a real server (storage off, a 4 GiB pool of 4 KiB slots); its anonymous resident
  memory (RssAnon: the pool's pages are shared memory, not counted) before and after a client
  reserves and commits 1,000,000 entries, per million.
- Storage index: the store's storage tier (`TieredStore.open`, an empty directory), its index
  given `--storage-entries` entries (10 million) the way the start-up scan adds the files it
  finds (`FileIndex.add_scanned`, 32-byte engine keys); this process's resident memory before and
  after, per million; then a 4,096-key prefix lookup (`TieredStore.lookup`, all storage hits),
  median and p99, against the same lookup measured with 4,096 entries indexed, in the same run.
- Write-through: a real server writing 1 GiB of 1 MiB entries to storage on disk (after a warm-up
  that starts its write-through processes); CPU seconds of the server and its write-through
  processes per GiB, against the floor measured here in the same run: the checksum the file format
  takes (xxh3-64 of the payload) and a write of the same bytes into new files in the page cache of
  the same file system. Target: within 1.5x of the floor.

    python -m bench.index_costs [--storage-entries 10000000] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import xxhash

from bench.harness import configs
from bench.harness.keys import keys as _keys
from bench.harness.keys import namespace
from bench.harness.report import log, median_p99_ms, timed, verdict
from bench.harness.server import SHM, server_env, start_server, stop_server
from hpkv.server.client import Client
from hpkv.store import TieredStore

MiB, GiB = 1 << 20, 1 << 30
TARGET_WRITE_RATIO = 1.5


def rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
    return 0


def dram_index(num_entries: int = 1_000_000) -> dict:
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-costs-", dir=SHM))
    env = server_env(pool_dir, pool_dir / "storage", HPKV_KV_MEM_POOL_SIZE="4g", HPKV_KV_STORAGE_ENABLE="0")
    try:
        proc = start_server(env)
        try:
            with Client(pool_dir, kind="bench-costs", autostart=False) as client:
                ns = client.register(namespace("costs-dram", 4096, num_layers=1))
                before = rss_anon(proc.pid)
                for start in range(0, num_entries, 4096):
                    batch = [i.to_bytes(32, "little") for i in range(start, min(start + 4096, num_entries))]
                    client.reserve(ns, batch)
                    client.commit(ns, batch)
                assert client.stats().dram.num_entries == num_entries
                after = rss_anon(proc.pid)
        finally:
            stop_server(proc)
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)
    return {"entries": num_entries, "bytes_per_million": (after - before) * 1_000_000 / num_entries}


def storage_index(num_entries: int) -> dict:
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-costs-", dir=SHM))
    storage_dir = Path(tempfile.mkdtemp(prefix="hpkv-costs-storage-"))
    store = TieredStore.open(configs.pool(pool_dir, 64 * MiB), configs.storage(storage_dir))
    try:
        assert store.storage is not None
        ns = store.register(namespace("costs-storage", 64 << 10, num_layers=1))
        while not store.stats().storage.index_ready:  # type: ignore[union-attr]
            time.sleep(0.01)
        index = store.storage.index
        prefix, value = index.key(ns, b""), index.value_of(64 << 10, time.time())
        keys = [i.to_bytes(32, "little") for i in range(4096)]
        index.add_scanned((prefix + k, value) for k in keys)
        small = median_p99_ms(timed(lambda: store.lookup(ns, keys), 200))
        gc.collect()
        before = psutil.Process().memory_info().rss
        index.add_scanned((prefix + i.to_bytes(32, "little"), value) for i in range(4096, num_entries))
        gc.collect()
        after = psutil.Process().memory_info().rss
        assert len(index) == num_entries
        assert store.lookup(ns, keys).num_hit == 4096
        large = median_p99_ms(timed(lambda: store.lookup(ns, keys), 200))
    finally:
        store.close()
        shutil.rmtree(pool_dir, ignore_errors=True)
        shutil.rmtree(storage_dir, ignore_errors=True)
    return {
        "entries": num_entries,
        "bytes_per_million": (after - before) * 1_000_000 / (num_entries - 4096),
        "lookup_4096_ms": {"median": large[0], "p99": large[1]},
        "lookup_4096_ms_with_4096_indexed": {"median": small[0], "p99": small[1]},
    }


def _cpu_s(proc: psutil.Process) -> float:
    """CPU seconds of `proc` and its live children (the write-through processes)."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def write_through(total_bytes: int = GiB, entry: int = MiB) -> dict:
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-costs-", dir=SHM))
    storage_dir = Path(tempfile.mkdtemp(prefix="hpkv-costs-wt-"))
    payload = np.random.default_rng(0).integers(0, 255, entry, dtype=np.uint8)
    try:
        os.sync()  # neither side pays for the other's dirty pages
        floor = _floor(storage_dir / "floor", payload, total_bytes // entry)
        shutil.rmtree(storage_dir / "floor")
        os.sync()
        proc = start_server(server_env(pool_dir, storage_dir, HPKV_KV_MEM_POOL_SIZE="2g"))
        server = psutil.Process(proc.pid)
        try:
            with Client(pool_dir, kind="bench-costs", autostart=False) as client:
                ns = client.register(namespace("costs-wt", entry, num_layers=1))

                def save(tag: str, n: int) -> None:
                    for start in range(0, n, 64):
                        batch = _keys(min(64, n - start), f"{tag}{start}-")
                        reservation = client.reserve(ns, batch)
                        pool = np.frombuffer(reservation.region.buf, dtype=np.uint8)
                        for offset in reservation.offsets:
                            assert offset is not None
                            np.copyto(pool[offset : offset + entry], payload)
                        client.commit(ns, batch)

                def written(n: int) -> None:
                    while client.stats().storage.writes < n:  # type: ignore[union-attr]
                        time.sleep(0.05)

                save("warm", 16)  # starts the write-through processes
                written(16)
                while (dram := client.stats().dram).ready_bytes < dram.capacity_bytes:
                    time.sleep(0.05)  # the pool's pages, reserved in the background: not this work
                cpu_before = _cpu_s(server)
                num = total_bytes // entry
                save("gib", num)
                written(16 + num)
                server_cpu = _cpu_s(server) - cpu_before
        finally:
            stop_server(proc)
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)
        shutil.rmtree(storage_dir, ignore_errors=True)
    gib = total_bytes / GiB
    return {"cpu_s_per_gib": server_cpu / gib, "floor_cpu_s_per_gib": floor / gib, "ratio": server_cpu / floor}


def _floor(directory: Path, payload: np.ndarray, num: int) -> float:
    """CPU seconds of the checksum and a copy into the page cache, `num` entries of `payload`."""
    directory.mkdir()
    start = time.thread_time()  # this thread's: not what other threads of the process do
    for i in range(num):
        xxhash.xxh3_64_intdigest(payload)
        fd = os.open(directory / f"{i}.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-entries", type=int, default=10_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    log("costs: DRAM index")
    dram = dram_index()
    log("costs: storage index")
    storage = storage_index(args.storage_entries)
    log("costs: write-through")
    writes = write_through()
    result = {"dram_index": dram, "storage_index": storage, "write_through": writes, "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"HPKV index and write-through costs ({result['cpus']} CPUs, load {os.getloadavg()[0]:.2f})")
    print(f"  DRAM index: {dram['bytes_per_million'] / MiB:.0f} MiB of server memory per million entries")
    big, small = storage["lookup_4096_ms"], storage["lookup_4096_ms_with_4096_indexed"]
    print(
        f"  storage index: {storage['bytes_per_million'] / MiB:.0f} MiB per million entries; a 4,096-key lookup"
        f" with {storage['entries']:,} indexed: median {big['median']:.2f} ms, p99 {big['p99']:.2f} ms"
        f" (with 4,096 indexed: {small['median']:.2f} ms = {big['median'] / small['median']:.2f}x)"
    )
    print(
        f"  write-through: {writes['cpu_s_per_gib']:.2f} CPU s/GiB vs floor {writes['floor_cpu_s_per_gib']:.2f}"
        f" = {writes['ratio']:.2f}x (target <= {TARGET_WRITE_RATIO}x: {verdict(writes['ratio'] <= TARGET_WRITE_RATIO)})"
    )


if __name__ == "__main__":
    main()
