"""Benchmark: what the model's identity (`hpkv.identity`: the sha256 of every byte of every weight
and config file, `hpkv.filedigest`) costs at an engine's first start and at later starts.

Targets: a later start (every file's digest remembered) under 1 s; a first start no longer than
the engine's own read of the weights (the baseline, measured in the same run: a sequential read
of real data from the device, page cache dropped).

Three parts:
1. Rates, on real (random) data in `--dir`: sha256 through `filedigest` of a `--rate-mib` file in
   the page cache (one core: the hash bound) and with its pages dropped (the device bound), and
   a plain read of it with its pages dropped (the engine's own read rate).
2. A first start on a checkpoint of the layout's file count scaled to `--first-gib` (sparse
   files: a hole reads as zeros at memory speed and sha256's cost does not depend on the data, so
   this is the page-cache figure), and the prediction for the full size: each file is hashed on
   a thread of its own, so max(total / (rate x threads), largest file / rate).
3. A later start on the full-size sparse checkpoint, measured: the digest cache holds an entry
   for every file (written by the script: a later start's cost is a stat, an open and a 200-byte
   read per file, whatever digest an entry holds).

    .venv/bin/python -m bench.model_fingerprint [--layouts 40,140,640] [--first-gib 2] [--dir /tmp]
        [--threads 8] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from hpkv import filedigest, identity

LATER_BUDGET_S = 1.0
TENSORS_PER_LAYER = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
# name: (GiB, files, layers, routed experts per layer)
LAYOUTS = {"40": (40, 1, 80, 0), "140": (140, 30, 80, 0), "640": (640, 163, 61, 256)}


def build(directory: Path, total_bytes: int, num_shards: int, num_layers: int, num_experts: int = 0) -> list[Path]:
    """A sparse checkpoint: every shard's header is real, its data a hole."""
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    names += [f"model.layers.{i}.{t}" for i in range(num_layers) for t in TENSORS_PER_LAYER]
    names += [
        f"model.layers.{i}.mlp.experts.{e}.{t}_proj.weight"
        for i in range(num_layers)
        for e in range(num_experts)
        for t in ("gate", "up", "down")
    ]
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for shard in range(num_shards):
        shard_names = names[shard * len(names) // num_shards : (shard + 1) * len(names) // num_shards]
        tensor_bytes = total_bytes // num_shards // len(shard_names) // 2 * 2
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in shard_names:
            header[name] = {
                "dtype": "BF16",
                "shape": [tensor_bytes // 2],
                "data_offsets": [offset, offset + tensor_bytes],
            }
            offset += tensor_bytes
        text = json.dumps(header).encode()
        path = directory / f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(8 + len(text) + offset)
        files.append(path)
    (directory / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": num_layers, "hidden_size": 8192})
    )
    return files


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def rates(directory: Path, num_mib: int) -> dict[str, float]:
    """GiB/s: sha256 in the page cache (one core), sha256 cold, a plain cold read."""
    path = directory / "random.bin"
    with open(path, "wb") as f:
        for _ in range(num_mib // 64):
            f.write(os.urandom(64 << 20))
    gib = path.stat().st_size / 2**30

    def timed(fn) -> float:
        started = time.perf_counter()
        fn()
        return gib / (time.perf_counter() - started)

    def plain_read() -> None:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass

    _drop(path)
    read_cold = timed(plain_read)
    timed(plain_read)  # into the page cache
    hash_cached = max(timed(lambda: filedigest._digest(path, None)) for _ in range(3))
    _drop(path)
    hash_cold = timed(lambda: filedigest._digest(path, None))
    path.unlink()
    return {"hash_cached_gib_s": hash_cached, "hash_cold_gib_s": hash_cold, "read_cold_gib_s": read_cold}


def first_start(directory: Path, layout: tuple[int, int, int, int], gib: float) -> tuple[float, int]:
    """(seconds, bytes hashed) of a first start on the layout scaled to `gib`, empty cache."""
    _, files, layers, experts = layout
    build(directory, int(gib * 2**30), files, layers, experts)
    identity.forget()
    started = time.perf_counter()
    found = identity.fingerprint(directory)
    return time.perf_counter() - started, found.num_bytes_read


def later_starts(directory: Path, layout: tuple[int, int, int, int], repeat: int) -> list[float]:
    """Seconds of `repeat` later starts on the full-size layout, every file's digest remembered."""
    total, files, layers, experts = layout
    paths = build(directory, total << 30, files, layers, experts)
    cache = filedigest._Cache.open()
    assert cache is not None, "no usable digest cache (see the warning)"
    for path in paths + [directory / "config.json"]:
        cache.put(path.stat(), "0" * 64)
    times = []
    for _ in range(repeat):
        identity.forget()
        started = time.perf_counter()
        found = identity.fingerprint(directory)
        times.append(time.perf_counter() - started)
        assert found.num_bytes_read == 0, "a later start read a file"
    return times


def predicted_first_s(layout: tuple[int, int, int, int], rate_gib_s: float, num_threads: int) -> float:
    total, files, _, _ = layout
    return max(total / (rate_gib_s * min(num_threads, files)), total / files / rate_gib_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="40,140,640", help=f"of {', '.join(LAYOUTS)} (GiB)")
    parser.add_argument("--first-gib", type=float, default=2.0, help="the first start's checkpoint, scaled down")
    parser.add_argument("--rate-mib", type=int, default=1024, help="real data for the rates")
    parser.add_argument("--threads", type=int, default=8, help="hashing threads of the node predicted for")
    parser.add_argument("--dir", default=None, help="where to build (default: the temp dir)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hpkv-fingerprint-", dir=args.dir))
    os.environ["XDG_CACHE_HOME"] = str(work / "cache")  # this run's digest cache
    filedigest.RACY_S = 0.0  # the sparse files are written a moment before they are hashed
    here_threads = max(1, min(16, (len(os.sched_getaffinity(0)) + 1) // 2))
    try:
        rate = rates(work, args.rate_mib)
        results = []
        for name in args.layouts.split(","):
            layout = LAYOUTS[name]
            first_s, hashed = first_start(work / f"first-{name}", layout, args.first_gib)
            shutil.rmtree(work / f"first-{name}")
            later = later_starts(work / f"later-{name}", layout, args.repeat)
            shutil.rmtree(work / f"later-{name}")
            results.append(
                {
                    "layout": f"{layout[0]} GiB, {layout[1]} file{'s' * (layout[1] > 1)}",
                    "first_scaled_gib": args.first_gib,
                    "first_scaled_s": first_s,
                    "first_scaled_gib_s": hashed / 2**30 / first_s,
                    "first_here_s": predicted_first_s(layout, rate["hash_cached_gib_s"], here_threads),
                    "first_node_s": predicted_first_s(layout, rate["hash_cached_gib_s"], args.threads),
                    "first_cold_here_s": predicted_first_s(layout, rate["hash_cold_gib_s"], here_threads),
                    "engine_read_cold_s": layout[0] / rate["read_cold_gib_s"],
                    "later_s": later,
                    "later_max_s": max(later),
                }
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(
            json.dumps({"rates": rate, "threads_here": here_threads, "threads_node": args.threads, "layouts": results})
        )
    else:
        print(
            f"rates: sha256 {rate['hash_cached_gib_s']:.2f} GiB/s per core in the page cache, "
            f"{rate['hash_cold_gib_s']:.2f} GiB/s from the device; the device's plain read "
            f"{rate['read_cold_gib_s']:.2f} GiB/s; hashing threads here {here_threads}, predicted node {args.threads}"
        )
        for r in results:
            print(
                f"{r['layout']}: later start {statistics.median(r['later_s']) * 1e3:.1f} ms median, "
                f"{r['later_max_s'] * 1e3:.1f} ms max (budget {LATER_BUDGET_S:.0f} s); first start at "
                f"{r['first_scaled_gib']:g} GiB {r['first_scaled_s']:.2f} s ({r['first_scaled_gib_s']:.2f} GiB/s); "
                f"full size predicted {r['first_here_s']:.0f} s here ({r['first_cold_here_s']:.0f} s cold), "
                f"{r['first_node_s']:.0f} s on {args.threads} threads; the engine's cold read here "
                f"{r['engine_read_cold_s']:.0f} s"
            )
    return 0 if all(r["later_max_s"] <= LATER_BUDGET_S for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
