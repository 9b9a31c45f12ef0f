"""The cluster tier's throughput against Mooncake Store's own zero-copy calls on the same objects,
in one run: a real `mooncake_master` and a segment process (`hpkv.cluster.segment`) on
127.0.0.1, and one client process (this one) holding no segment, so every byte crosses TCP
loopback to the other process, as between two nodes.

    python -m bench.cluster_tier [--rounds 5] [--round-mib 64] [--json]

Per object size (256 KiB and 4 MiB), each round moves `--round-mib` of fresh objects (a put of an
existing name does nothing in Mooncake) from and into one registered buffer:
- `mooncake put`/`get`: `batch_put_from` / `batch_get_into`, the payload alone;
- `tier write`/`read`: `ClusterTier.write` / `read_into`, what the HPKV server runs: the header
  built (xxh3 of the payload) and put with the payload in one object
  (`batch_put_from_multi_buffers`), read back into a header buffer and the slot
  (`batch_get_into_multi_buffers`) and checked (xxh3 again);
- `xxh3`: the checksum alone over the same bytes, what the tier adds per byte.
Rounds of the two alternate. Figures are the median MB/s (10^6 bytes/s) of `--rounds`, and the
tier's ratio to Mooncake's own call (the issue's target: at least 0.8). Run it under
`flock /tmp/hpkv-engine.lock` on a shared machine. Progress to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import xxhash

from bench.harness.mooncake import start_master, start_segment, stop_master
from bench.harness.report import log
from hpkv.cluster.client import ClusterClient, load_store_class
from hpkv.cluster.tier import ClusterTier, address_of
from hpkv.config import ClusterConfig

NS = "c1" * 16
SIZES = (256 << 10, 4 << 20)


def mbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e6


def run_size(size: int, rounds: int, round_bytes: int, memory: mmap.mmap, raw, tier: ClusterTier) -> dict:
    count = round_bytes // size
    base = address_of(memory)
    ptrs, sizes = [base + i * size for i in range(count)], [size] * count
    slots_of = lambda keys: [(k, i * size, size) for i, k in enumerate(keys)]  # noqa: E731
    got: dict[str, list[float]] = {k: [] for k in ("mooncake put", "mooncake get", "tier write", "tier read", "xxh3")}
    for r in range(rounds):
        memory[: count * size] = os.urandom(count * size)
        names = [f"bench/{size}/{r}/{i}" for i in range(count)]
        keys = [f"{size}-{r}-{i}".encode() for i in range(count)]
        t = time.perf_counter()
        assert raw.batch_put_from(names, ptrs, sizes) == [0] * count
        got["mooncake put"].append(mbps(count * size, time.perf_counter() - t))
        t = time.perf_counter()
        assert tier.write(NS, slots_of(keys)) == count
        got["tier write"].append(mbps(count * size, time.perf_counter() - t))
        t = time.perf_counter()
        assert raw.batch_get_into(names, ptrs, sizes) == sizes
        got["mooncake get"].append(mbps(count * size, time.perf_counter() - t))
        t = time.perf_counter()
        assert tier.read_into(NS, slots_of(keys)) == [True] * count
        got["tier read"].append(mbps(count * size, time.perf_counter() - t))
        view = memoryview(memory)
        t = time.perf_counter()
        for i in range(count):
            xxhash.xxh3_64_intdigest(view[i * size : (i + 1) * size])
        got["xxh3"].append(mbps(count * size, time.perf_counter() - t))
        view.release()
        raw.batch_remove(names, True)
        tier.client.remove([f"hpkv/{NS}/{k.hex()}" for k in keys])
        log(f"{size >> 10} KiB round {r + 1}/{rounds} done")
    med = {k: round(statistics.median(v)) for k, v in got.items()}
    return {
        "object_bytes": size,
        "objects_per_round": count,
        "median_mbps": med,
        "write_ratio": round(med["tier write"] / med["mooncake put"], 2),
        "read_ratio": round(med["tier read"] / med["mooncake get"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-mib", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    round_bytes = args.round_mib << 20
    work = Path(tempfile.mkdtemp(prefix="hpkv-bench-cluster-"))
    master, address = start_master(work)
    config = ClusterConfig(
        enabled=True,
        master=address,
        host="127.0.0.1",
        segment_bytes=4 * round_bytes + (64 << 20),
        buffer_bytes=16 << 20,
    )
    from hpkv.cluster import segment

    results = []
    try:
        start_segment(work, config)
        memory = mmap.mmap(-1, round_bytes)
        raw = load_store_class()()
        assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", address) == 0
        raw.register_buffer(address_of(memoryview(memory)), round_bytes)
        tier = ClusterTier(config, memoryview(memory), ClusterClient(config))
        assert tier.start()
        for size in SIZES:
            results.append(run_size(size, args.rounds, round_bytes, memory, raw, tier))
        tier.close()
        raw.close()
    finally:
        segment.stop(work)
        stop_master(master)
    out = {"load_average": os.getloadavg(), "cpus": os.cpu_count(), "sizes": results}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"cluster tier vs Mooncake's own calls, TCP loopback, {args.rounds} rounds of {args.round_mib} MiB")
    print(
        f"{'object':>8} {'mc put':>8} {'tier wr':>8} {'ratio':>6} {'mc get':>8} {'tier rd':>8} {'ratio':>6} {'xxh3':>8}"
    )
    for r in results:
        m = r["median_mbps"]
        print(
            f"{r['object_bytes'] >> 10:>5}KiB {m['mooncake put']:>8} {m['tier write']:>8} {r['write_ratio']:>6} "
            f"{m['mooncake get']:>8} {m['tier read']:>8} {r['read_ratio']:>6} {m['xxh3']:>8}"
        )
    print(f"load average {out['load_average'][0]:.1f} on {out['cpus']} CPUs; MB/s = 10^6 bytes/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
