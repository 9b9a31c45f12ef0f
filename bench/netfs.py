"""The storage tier shared by two nodes over a real network file system, against a plain copy
through the same mounts.

    python -m bench.netfs [--entries 128] [--rounds 3] [--json]

Sets up GlusterFS (default client caching) and MooseFS, each mounted twice on this machine
(`bench.harness.netfs`, as root), plus a local directory as a baseline, and measures per file
system, with 1 MiB entries: node A's tier writing (`write_from`: checksums, temporary, rename)
against a plain copy of the same files (into the same fan-out directories, made as needed: write
a temporary, rename it, no fsync) through A's mount; node B's tier
reading what A wrote (`read_into`: open, read, verify) against a plain first read of the plain
copy's files through B's mount. Each round writes new files; the best round counts. Target:
the tier at 0.7x the plain copy or better in each direction. Targets print PASS/MISS, never
asserted; progress to stderr, the table (or --json) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.harness.netfs import local_and_shared
from bench.harness.report import log, verdict
from hpkv.config import StorageConfig
from hpkv.storage.storage_tier import StorageTier

MIB = 1 << 20
NS = "cd" * 16
TARGET = 0.7


@dataclass
class Row:
    fs: str
    direction: str
    hpkv_mib_s: float
    plain_mib_s: float

    @property
    def ratio(self) -> float:
        return self.hpkv_mib_s / self.plain_mib_s


def _tier(root: Path) -> StorageTier:
    tier = StorageTier(StorageConfig(path=root, enabled=True, capacity_bytes=64 << 30, fsync="off", io_threads=1))
    tier.start()
    tier.scan_done.wait(60)
    return tier


def _plain_path(directory: Path, key: bytes) -> Path:
    """The tier's layout (`<ab>/<cd>/<hex>`), so both make the same directories."""
    name = key.hex()
    return directory / name[:2] / name[2:4] / name


def _plain_write(directory: Path, data: bytes, keys: list[bytes]) -> float:
    started = time.perf_counter()
    for key in keys:
        path = _plain_path(directory, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.rename(tmp, path)
    return len(keys) * len(data) / MIB / (time.perf_counter() - started)


def _plain_read(directory: Path, keys: list[bytes]) -> float:
    buf = bytearray(MIB)
    started = time.perf_counter()
    for key in keys:
        with open(_plain_path(directory, key), "rb", buffering=0) as f:
            assert f.readinto(buf) == MIB
    return len(keys) * MIB / MIB / (time.perf_counter() - started)


def _round(a_root: Path, b_root: Path, n: int) -> tuple[float, float, float, float]:
    """(tier write, plain write, tier read, plain read) in MiB/s, on new files."""
    tag = secrets.token_hex(4)
    plain_a, plain_b = a_root / f"plain-{tag}", b_root / f"plain-{tag}"
    plain_a.mkdir()
    data = secrets.token_bytes(MIB)
    keys = [secrets.token_bytes(16) for _ in range(n)]
    a, b = _tier(a_root / f"tier-{tag}"), None
    try:
        plain_w = _plain_write(plain_a, data, keys)
        started = time.perf_counter()
        for k in keys:
            assert a.write_from(NS, k, memoryview(data))
        tier_w = n / (time.perf_counter() - started)
        time.sleep(1.5)  # the cross-mount lag of a new directory's listing and attributes
        b = _tier(b_root / f"tier-{tag}")
        dest = bytearray(MIB)
        started = time.perf_counter()
        for k in keys:
            assert b.contains(NS, k) and b.read_into(NS, k, memoryview(dest))
        tier_r = n / (time.perf_counter() - started)
        plain_r = _plain_read(plain_b, keys)
        return tier_w, plain_w, tier_r, plain_r
    finally:
        for tier in (a, b):
            if tier is not None:
                tier.close()
        shutil.rmtree(plain_a, ignore_errors=True)
        shutil.rmtree(a_root / f"tier-{tag}", ignore_errors=True)


def measure(name: str, a_root: Path, b_root: Path, n: int, rounds: int) -> list[Row]:
    results = [_round(a_root, b_root, n) for _ in range(rounds)]
    best = [max(r[i] for r in results) for i in range(4)]
    log(f"{name}: write {best[0]:.0f} vs {best[1]:.0f} MiB/s, read {best[2]:.0f} vs {best[3]:.0f} MiB/s")
    return [Row(name, "write", best[0], best[1]), Row(name, "read", best[2], best[3])]


def run(n: int, rounds: int) -> list[Row]:
    rows: list[Row] = []
    for name, a_root, b_root in local_and_shared("hpkv-bench-netfs-", "local (ext4 or what /var/tmp is)"):
        rows += measure(name, a_root, b_root, n, rounds)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=128, help="1 MiB entries per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(args.entries, args.rounds)
    if args.json:
        print(json.dumps([{**asdict(r), "ratio": r.ratio} for r in rows], indent=1))
        return
    print(f"{'file system':<36} {'dir':<6} {'HPKV MiB/s':>11} {'plain MiB/s':>12} {'ratio':>6}  target >= {TARGET}x")
    for r in rows:
        print(
            f"{r.fs:<36} {r.direction:<6} {r.hpkv_mib_s:>11.0f} {r.plain_mib_s:>12.0f} {r.ratio:>5.2f}x  "
            f"{verdict(r.ratio >= TARGET)}"
        )


if __name__ == "__main__":
    main()
