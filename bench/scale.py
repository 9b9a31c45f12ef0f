"""Scale: an HPKV server's start-up and an engine's attach, against the size of the pool.

For pools of 1, 4 and 16 GiB (each size only where MemAvailable keeps HEADROOM_GIB to spare; the
others are printed as skipped, with the reason), on tmpfs (/dev/shm) and, where this process may
mount one (root), on a fresh tmpfs mounted huge=within_size (2 MiB pages), it measures:
- ready: from spawning `python -m hpkv.server.daemon` (storage off) to its socket answering;
- attach: a copying client's connect (handshake, pool descriptor, map, prefault started): what
  each engine process pays;
- first hit: from ready to a 1 MiB entry written through the pool and found in DRAM;
- full: from ready until the server says every page is reserved (in the background; shown only);
- in the same run, the floor of `ready`: a Python start that imports the server module.
Slope: least squares of ready (and attach) in s per GiB over the sizes measured, extrapolated to
1 TiB. Targets: ready <= 2 s and attach <= 1 s at every size, slope < 0.05 s/GiB.

    python -m bench.scale [--sizes 1,4,16] [--json]

Run it alone on the machine (other processes' page faults share the cores); the pools take their
memory only while measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness.keys import keys as _keys
from bench.harness.keys import namespace
from bench.harness.report import log, verdict
from bench.harness.server import SHM, huge_tmpfs, server_env, stop_server
from hpkv.server.autostart import answers
from hpkv.server.client import Client
from hpkv.server.protocol import SOCKET_NAME
from hpkv.tiers import Tier

GiB = 1 << 30
HEADROOM_GIB = 3
ENTRY = 1 << 20
TARGET_READY_S, TARGET_ATTACH_S, TARGET_SLOPE = 2.0, 1.0, 0.05


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    return 0


def import_floor_s() -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import hpkv.server.daemon"], check=True)
    return time.monotonic() - start


def measure(parent: Path, size_gib: int) -> dict:
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-scale-", dir=parent))
    env = server_env(pool_dir, pool_dir / "storage", HPKV_KV_MEM_POOL_SIZE=f"{size_gib}g", HPKV_KV_STORAGE_ENABLE="0")
    try:
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "hpkv.server.daemon"], env=env, stdin=subprocess.DEVNULL)
        while not answers(pool_dir / SOCKET_NAME):
            if proc.poll() is not None:
                raise SystemExit(f"the HPKV server exited at start ({size_gib} GiB in {parent})")
            time.sleep(0.005)
        ready = time.monotonic()
        try:
            client = Client(pool_dir, kind="bench-scale", autostart=False, prefault=True)
            client.connect()
            attached = time.monotonic()
            ns = client.register(namespace("scale", ENTRY, dtype="bfloat16", num_layers=1))
            key = _keys(1, "first")
            reservation = client.reserve(ns, key)
            assert reservation.offsets[0] is not None, "no slot right after start"
            offset = reservation.offsets[0]
            np.frombuffer(reservation.region.buf, dtype=np.uint8)[offset : offset + ENTRY] = 7
            client.commit(reservation)
            assert list(client.lookup(ns, key).tiers) == [Tier.DRAM]
            hit = time.monotonic()
            while (stats := client.stats().dram).ready_bytes < stats.capacity_bytes:
                time.sleep(0.05)
            full = time.monotonic()
            client.close()
        finally:
            stop_server(proc)
        return {
            "size_gib": size_gib,
            "ready_s": ready - start,
            "attach_s": attached - ready,
            "first_hit_s": hit - ready,
            "full_s": full - ready,
        }
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)


def slope(points: list[dict], field: str) -> float | None:
    if len(points) < 2:
        return None
    x = np.array([p["size_gib"] for p in points], dtype=float)
    y = np.array([p[field] for p in points], dtype=float)
    return float(np.polyfit(x, y, 1)[0])


def run(sizes: list[int]) -> dict:
    result: dict = {"import_floor_s": import_floor_s(), "cpus": os.cpu_count(), "file_systems": {}, "skipped": []}
    with huge_tmpfs(max(sizes) * GiB + GiB) as huge:
        places = {"tmpfs (4 KiB pages)": SHM}
        if huge is None:
            result["skipped"].append("tmpfs huge=within_size: cannot mount one here (needs root)")
        else:
            places["tmpfs huge=within_size"] = huge
        for name, parent in places.items():
            points = []
            for size in sizes:
                left = mem_available()
                if left < (size + HEADROOM_GIB) * GiB:
                    result["skipped"].append(
                        f"{name}, {size} GiB: MemAvailable is {left / GiB:.1f} GiB, under {size + HEADROOM_GIB}"
                    )
                    continue
                log(f"scale: {name}, {size} GiB")
                points.append(measure(parent, size))
            result["file_systems"][name] = {
                "points": points,
                "ready_slope_s_per_gib": slope(points, "ready_s"),
                "attach_slope_s_per_gib": slope(points, "attach_s"),
            }
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return result


def report(result: dict) -> None:
    print(f"HPKV scale benchmark ({result['cpus']} CPUs, load {result['load_avg_1m']})")
    print(f"  floor: a Python start importing the server: {result['import_floor_s']:.2f} s")
    for name, fs in result["file_systems"].items():
        print(f"  {name}:")
        for p in fs["points"]:
            print(
                f"    {p['size_gib']:>3} GiB: ready {p['ready_s']:.2f} s ({verdict(p['ready_s'] <= TARGET_READY_S)}),"
                f" attach {p['attach_s'] * 1e3:.0f} ms ({verdict(p['attach_s'] <= TARGET_ATTACH_S)}),"
                f" first hit {p['first_hit_s'] * 1e3:.0f} ms after ready; every page reserved"
                f" {p['full_s']:.1f} s after ready"
            )
        for what in ("ready", "attach"):
            value = fs[f"{what}_slope_s_per_gib"]
            if value is not None:
                print(
                    f"    {what} slope {value:+.4f} s/GiB ({verdict(value < TARGET_SLOPE)} < {TARGET_SLOPE}),"
                    f" extrapolated to 1 TiB: +{max(value, 0) * 1024:.1f} s"
                )
    for why in result["skipped"]:
        print(f"  skipped: {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16", help="pool sizes in GiB, comma-separated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run([int(s) for s in args.sizes.split(",")])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result)


if __name__ == "__main__":
    main()
