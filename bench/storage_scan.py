"""Benchmark: how long a storage tier takes to index a directory of many entry files at start,
what the index costs in memory, and whether lookups hit while it is built.

A server that starts on a storage directory another server filled walks it in the background
(`StorageTier._scan`) to learn every file's key, size and age; lookups do not wait for that walk,
a key not indexed yet costs one `stat` of its file. This script fills a fresh directory with
`--files` entry files in HPKV's layout (`<ns>/ab/cd/<key>.kv`, written with the tier's own
`write_from`, `--entry-bytes` each), then starts fresh tiers on it (a real `StorageTier`, as the
server builds it) and times:
- the walk with the directory's metadata in the kernel's caches (a restart);
- the walk after dropping those caches (a reboot; needs root, skipped otherwise);
- a lookup and a read of a file the index has not reached yet, during the walk;
- the resident memory the index adds, per million files.
The directory is removed at the end.

    .venv/bin/python -m bench.storage_scan [--files 200000] [--entry-bytes 4096] [--storage-dir .] [--no-cold] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.harness import configs
from bench.harness.keys import key, namespace
from hpkv.config import StorageConfig
from hpkv.storage.storage_tier import StorageTier

NS = namespace("storage-scan", 4096).ns


def key_of(i: int) -> bytes:
    return key(f"scan-{i}")


def config(path: Path) -> StorageConfig:
    return configs.storage(path, capacity_bytes=1 << 50)


def fill(path: Path, num_files: int, entry_bytes: int) -> float:
    tier = StorageTier(config(path))
    tier.start()
    payload = memoryview(bytes(entry_bytes))
    started = time.perf_counter()
    for i in range(num_files):
        if not tier.write_from(NS, key_of(i), payload):
            raise SystemExit(f"could not write file {i} under {path}")
        if i and i % 100_000 == 0:
            print(f"  {i} files written", file=sys.stderr)
    elapsed = time.perf_counter() - started
    tier.close()
    return elapsed


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def scan(path: Path, probe_key: bytes, entry_bytes: int) -> dict:
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    tier = StorageTier(config(path))
    started = time.perf_counter()
    tier.start()
    # During the walk: the key of a file it may not have reached yet, as an engine would ask.
    probe_started = time.perf_counter()
    found = tier.contains(NS, probe_key)
    dest = memoryview(bytearray(entry_bytes))
    read = tier.read_into(NS, probe_key, dest)
    probe_s = time.perf_counter() - probe_started
    tier.scan_done.wait()
    elapsed = time.perf_counter() - started
    gc.collect()
    rss_after = psutil.Process().memory_info().rss
    indexed = tier.stats().num_entries
    tier.close()
    return {
        "seconds": elapsed,
        "files_indexed": indexed,
        "probe_hit": found and read,
        "probe_ms": probe_s * 1e3,
        "index_rss_bytes": rss_after - rss_before,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=200_000)
    p.add_argument("--entry-bytes", type=int, default=4096, help="size of each entry's payload")
    p.add_argument("--storage-dir", default=".", help="parent of the storage temporary")
    p.add_argument(
        "--no-cold",
        dest="cold",
        action="store_false",
        help="skip the walk after dropping the kernel's caches (which slows everything else)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="hpkv-scan-", dir=args.storage_dir))
    try:
        print(f"writing {args.files} entry files under {root}", file=sys.stderr)
        fill_s = fill(root, args.files, args.entry_bytes)
        probe = key_of(args.files - 1)
        out = {
            "files": args.files,
            "entry_bytes": args.entry_bytes,
            "fill_seconds": fill_s,
            "warm": scan(root, probe, args.entry_bytes),
        }
        out["cold"] = scan(root, probe, args.entry_bytes) if args.cold and drop_caches() else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    per_million = 1e6 / args.files
    print(f"{args.files} files of {args.entry_bytes} bytes (written in {fill_s:.1f} s)")
    for name in ("warm", "cold"):
        r = out[name]
        if r is None:
            print(f"{name:5} skipped: --no-cold, or not root (dropping the kernel's caches needs root)")
            continue
        print(
            f"{name:5} index of {r['files_indexed']} files in {r['seconds']:.1f} s "
            f"({r['seconds'] * per_million:.1f} s per million); a lookup and read of an unindexed file during it: "
            f"{'hit' if r['probe_hit'] else 'MISS'} in {r['probe_ms']:.1f} ms; index memory "
            f"{r['index_rss_bytes'] * per_million / 2**20:.0f} MiB per million files"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
