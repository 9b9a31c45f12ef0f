"""Benchmark: what the model's content fingerprint (`hpkv.identity`) costs an engine at start,
against its budget of one second.

It builds a model directory the size of a large checkpoint without the disk space: a config.json
and `--shards` safetensors files of `--gib` GiB in all, whose headers describe `--layers` layers
of 9 tensors each (a 70B-class layout) and whose data is a sparse hole. It then times the
fingerprint as an engine process computes it once at start (the process cache dropped before each
of `--repeat` runs), and, as the baseline measured in the same run, a plain sequential read of
`--baseline-mib` MiB of the same files. A hole reads as zeros without touching the device, so
both figures are the CPU and system-call cost; on a real checkpoint the engine has just loaded
the weights, so the pages the fingerprint reads are usually still in the page cache (the script
prints how many reads it makes, to price a cold cache: reads x the device's latency).
`--model-dir DIR` fingerprints a real model directory instead (no baseline).

    .venv/bin/python -m bench.model_fingerprint [--gib 40] [--shards 1] [--layers 80] [--experts 0] [--dir /tmp]
        [--repeat 5] [--json]
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

from hpkv import identity

BUDGET_S = 1.0
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
    files = []
    for shard in range(num_shards):
        shard_names = names[shard * len(names) // num_shards : (shard + 1) * len(names) // num_shards]
        data_bytes = total_bytes // num_shards
        tensor_bytes = data_bytes // len(shard_names) // 2 * 2
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


def time_fingerprint(directory: Path, repeat: int) -> tuple[list[float], list[float], identity.ModelIdentity]:
    """(wall seconds, CPU seconds of this process, the identity) of `repeat` fingerprints."""
    times, cpu, found = [], [], None
    for _ in range(repeat):
        identity.forget()  # as a fresh engine process
        started, started_cpu = time.perf_counter(), time.process_time()
        found = identity.content_identity(str(directory))
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return times, cpu, found


def time_baseline(files: list[Path], num_bytes: int) -> float:
    """A sequential read of `num_bytes` from the middle of the files, 1 MiB at a time."""
    started = time.perf_counter()
    left = num_bytes
    for path in files:
        with open(path, "rb", buffering=0) as f:
            f.seek(os.path.getsize(path) // 2)
            while left > 0 and (chunk := f.read(min(1 << 20, left))):
                left -= len(chunk)
        if left <= 0:
            break
    return time.perf_counter() - started


def num_reads(files: list[Path]) -> int:
    """Reads of the fingerprint, as `identity._hash_samples` plans them."""
    per_file = max(16, min(identity.MAX_TENSOR_SAMPLES, identity.TENSOR_SAMPLE_BUDGET // len(files)))
    chunks = max(2, min(identity.NUM_CHUNKS, identity.CHUNK_BUDGET // len(files)))
    reads = 0
    for path in files:
        with open(path, "rb") as f:
            header = identity._safetensors_header(f, os.path.getsize(path))
        tensors = len(header[1]) if header else 2
        reads += 1 + len(range(0, tensors, max(1, -(-tensors // per_file)))) + chunks
    return reads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=40.0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--experts", type=int, default=0, help="routed experts per layer (MoE: 3 tensors each)")
    parser.add_argument("--dir", default=None, help="where to build the sparse model (default: the temp dir)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline-mib", type=int, default=64)
    parser.add_argument("--model-dir", default=None, help="fingerprint this real model directory instead")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    if args.model_dir:
        times, _, found = time_fingerprint(Path(args.model_dir), args.repeat)
        result = {
            "model_dir": args.model_dir,
            "fingerprint_s": times,
            "bytes_read": found.num_bytes_read,
            "source": found.source,
        }
        print(
            json.dumps(result)
            if args.json
            else f"{found.source}: {statistics.median(times) * 1e3:.1f} ms median, {max(times) * 1e3:.1f} ms max "
            f"(first {times[0] * 1e3:.1f} ms), {found.num_bytes_read / 2**20:.1f} MiB read; budget "
            f"{BUDGET_S:.0f} s"
        )
        return 0
    directory = Path(tempfile.mkdtemp(prefix="hpkv-fingerprint-", dir=args.dir))
    try:
        files = build(directory, int(args.gib * 2**30), args.shards, args.layers, args.experts)
        baseline_s = time_baseline(files, args.baseline_mib << 20)
        times, cpu, found = time_fingerprint(directory, args.repeat)
        result = {
            "gib": args.gib,
            "shards": args.shards,
            "tensors": 3 + (9 + 3 * args.experts) * args.layers,
            "fingerprint_s": times,
            "median_s": statistics.median(times),
            "max_s": max(times),
            "cpu_s": cpu,
            "cpu_median_s": statistics.median(cpu),
            "budget_s": BUDGET_S,
            "bytes_read": found.num_bytes_read,
            "reads": num_reads(files),
            "baseline_mib": args.baseline_mib,
            "baseline_s": baseline_s,
            "source": found.source,
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return 0
    median, worst = result["median_s"], result["max_s"]
    print(
        f"model: {args.gib:g} GiB in {args.shards} sparse safetensors file(s), {result['tensors']} tensors, "
        f"and a config.json"
    )
    print(
        f"fingerprint: {median * 1e3:.1f} ms median, {worst * 1e3:.1f} ms max of {args.repeat} "
        f"({worst / BUDGET_S:.1%} of the {BUDGET_S:.0f} s budget); CPU {result['cpu_median_s'] * 1e3:.1f} ms "
        f"median; {result['reads']} reads, {result['bytes_read'] / 2**20:.2f} MiB"
    )
    print(
        f"baseline: reading {args.baseline_mib} MiB of the same files sequentially: {baseline_s * 1e3:.1f} ms "
        f"(the fingerprint costs {median / baseline_s:.2f}x that)"
    )
    print(f"identity source: {result['source']}")
    return 0 if worst <= BUDGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
