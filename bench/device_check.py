"""Device check: HPKV's block copies between a GPU's paged KV cache and the pinned DRAM pool.

    python bench/device_check.py [--json] [--device cpu]

On a machine with an NVIDIA GPU it:
1. creates a real pool (`PoolRegion.create`, a fresh directory under /dev/shm, 4 GiB or less when
   /dev/shm has less room) and registers it as pinned memory through `PoolTensors`, as the
   connector's worker does (reported: registered or not, and how long it took);
2. builds a fake paged KV cache on the GPU shaped like Qwen2.5-1.5B at block size 32: 28 layers,
   each `(num_blocks, page_bytes)` with page = 2 (K,V) x 32 tokens x 2 KV heads x 128 x 2 bytes
   (bf16) = 32 KiB, so one pool entry (all layers of a block) is 896 KiB;
3. times `BlockCopier.save` (GPU -> pool) and `BlockCopier.load` (pool -> GPU) of 256 blocks,
   with the engine's block ids scattered at random and, in a second pair of rows, consecutive
   (pool offsets are consecutive slots, as one reservation hands them out);
4. in the same run, times the limit: one `copy_` of the same number of bytes between a GPU tensor
   and a `torch.empty(..., pin_memory=True)` buffer; and, as a diagnosis row, the same per-page
   copies as the copier but to/from that torch-pinned buffer (what pinning alone would give).
Every copy is checked: the loaded blocks must equal the saved ones, byte for byte.

Without CUDA it prints "no CUDA device: skipped" and exits 0. `--device cpu` runs the same logic
with a CPU "device" (no pinning), to test the script itself. Figures are GB/s (10^9 bytes/s),
the median of `--reps` timed rounds after one warm-up round. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

GB = 1e9
SHM = Path("/dev/shm")
# Qwen2.5-1.5B: 28 layers, 2 KV heads of 128, bf16; vLLM block size 32.
QWEN_LAYERS, QWEN_PAGE_BYTES = 28, 2 * 32 * 2 * 128 * 2
SLOT_ALIGN = 4096  # hpkv.pool.slots.SLOT_ALIGN: slots are page-aligned


@dataclass(frozen=True)
class Options:
    device: str
    pool_bytes: int
    num_layers: int
    page_bytes: int
    num_blocks: int  # blocks in the fake paged KV cache
    num_moved: int  # blocks per save / load
    reps: int
    json: bool


@dataclass
class Row:
    measure: str
    pattern: str
    gbps: float
    limit_gbps: float | None

    @property
    def ratio(self) -> float | None:
        return self.gbps / self.limit_gbps if self.limit_gbps else None


def parse_args(argv: list[str]) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--pool-gib", type=float, default=4.0, help="at most this; less if /dev/shm is smaller")
    p.add_argument("--layers", type=int, default=QWEN_LAYERS)
    p.add_argument("--page-bytes", type=int, default=QWEN_PAGE_BYTES)
    p.add_argument("--kv-blocks", type=int, default=1024, help="blocks in the fake paged KV cache")
    p.add_argument("--blocks", type=int, default=256, help="blocks moved per save / load")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    return Options(a.device, int(a.pool_gib * 2**30), a.layers, a.page_bytes, a.kv_blocks,
                   min(a.blocks, a.kv_blocks // 2), a.reps, a.json)


def pool_size(opts: Options, slot_bytes: int) -> int:
    """What /dev/shm can take (half its free room at most), whole slots, at least the blocks moved."""
    free = shutil.disk_usage(SHM).free
    size = min(opts.pool_bytes, free // 2)
    size -= size % (1 << 20)
    if size < opts.num_moved * slot_bytes:
        raise SystemExit(f"/dev/shm has {free / 2**20:.0f} MiB free: too little for {opts.num_moved} entries of "
                         f"{slot_bytes / 2**10:.0f} KiB; use --blocks or --layers to shrink the check")
    return size


def timed(fn, reps: int, sync) -> list[float]:
    fn()
    sync()
    out = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - started)
    return out


def gbps(num_bytes: int, seconds: list[float]) -> float:
    return num_bytes / statistics.median(seconds) / GB


def run(opts: Options) -> dict:
    import torch

    from hpkv.pool.region import PoolRegion
    from hpkv.transfer.blocks import BlockCopier

    device = torch.device(opts.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    entry_bytes = opts.num_layers * opts.page_bytes
    slot_bytes = -(-entry_bytes // SLOT_ALIGN) * SLOT_ALIGN
    size = pool_size(opts, slot_bytes)
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-device-check-", dir=SHM))
    region = None
    try:
        region = PoolRegion.create(pool_dir, size)
        gen = torch.Generator(device="cpu").manual_seed(0)  # block ids
        fill = torch.Generator(device=device).manual_seed(0)  # cache bytes, made where they live
        views = [torch.randint(-128, 128, (opts.num_blocks, opts.page_bytes), dtype=torch.int8, device=device,
                               generator=fill) for _ in range(opts.num_layers)]
        copier = BlockCopier(views, tuple(i * opts.page_bytes for i in range(opts.num_layers)))
        started = time.perf_counter()
        copier.pools.get(region)  # maps the pool and registers it, as the worker's first copy does
        register_s = time.perf_counter() - started
        rows, checks = copier_rows(opts, copier, region, slot_bytes, sync, gen)
        rows += limit_rows(opts, views, slot_bytes, sync, gen)
        pinned = copier.pools.pinned
        unregister(copier, region)
        del copier, views
        gc.collect()  # the pool's tensor views must be gone before it is unmapped
        return {"pool_bytes": size, "pool_pinned": pinned, "register_s": register_s,
                "entry_bytes": entry_bytes, "rows": rows, "checks": checks}
    finally:
        if region is not None:
            try:
                region.close()
            except BufferError:
                pass  # a failed run still holds views of the map; the file goes with its directory
        shutil.rmtree(pool_dir, ignore_errors=True)


def copier_rows(opts: Options, copier, region, slot_bytes: int, sync, gen) -> tuple[list[Row], dict]:
    import torch

    moved = opts.num_moved * copier.entry_bytes
    offsets = [i * slot_bytes for i in range(opts.num_moved)]
    rows, checks = [], {}
    patterns = {
        "random": torch.randperm(opts.num_blocks, generator=gen)[: 2 * opts.num_moved].tolist(),
        "consecutive": list(range(2 * opts.num_moved)),
    }
    for pattern, ids in patterns.items():
        src, dst = ids[: opts.num_moved], ids[opts.num_moved :]
        save_s = timed(lambda: copier.save(region, src, offsets), opts.reps, sync)
        load_s = timed(lambda: copier.load(region, dst, offsets), opts.reps, sync)
        checks[f"{pattern}: loaded blocks equal the saved blocks"] = all(
            torch.equal(v[dst], v[src]) for v in copier.layer_views)
        rows.append(Row("save: device -> pool (BlockCopier)", pattern, gbps(moved, save_s), None))
        rows.append(Row("load: pool -> device (BlockCopier)", pattern, gbps(moved, load_s), None))
    return rows, checks


def limit_rows(opts: Options, views, slot_bytes: int, sync, gen) -> list[Row]:
    """One big copy per direction (the limit), and the copier's per-page copies against a
    torch-pinned buffer instead of the registered pool (what pinning alone would give)."""
    import torch

    num_bytes = opts.num_moved * opts.num_layers * opts.page_bytes
    pin = views[0].device.type == "cuda"
    host = torch.empty(opts.num_moved * slot_bytes, dtype=torch.int8, pin_memory=pin)
    device = torch.empty(num_bytes, dtype=torch.int8, device=views[0].device)
    limit = {"save": gbps(num_bytes, timed(lambda: host[:num_bytes].copy_(device, non_blocking=pin), opts.reps, sync)),
             "load": gbps(num_bytes, timed(lambda: device.copy_(host[:num_bytes], non_blocking=pin), opts.reps, sync))}
    ids = torch.randperm(opts.num_blocks, generator=gen)[: opts.num_moved].tolist()
    rows_host = host.as_strided((opts.num_moved, slot_bytes), (slot_bytes, 1))

    def pages(save: bool) -> None:
        for layer, view in enumerate(views):
            offset = layer * opts.page_bytes
            for i, block in enumerate(ids):
                pool_page = rows_host[i, offset : offset + opts.page_bytes]
                if save:
                    pool_page.copy_(view[block], non_blocking=pin)
                else:
                    view[block].copy_(pool_page, non_blocking=pin)

    per_page = {"save": gbps(num_bytes, timed(lambda: pages(True), opts.reps, sync)),
                "load": gbps(num_bytes, timed(lambda: pages(False), opts.reps, sync))}
    kind = "pinned" if pin else "plain"
    return [Row(f"{d}: one {kind} copy_ of the same bytes (limit)", "contiguous", limit[d], None) for d in limit] + \
           [Row(f"{d}: per-page copy_, non_blocking, torch {kind} buffer", "random", per_page[d], None)
            for d in per_page]


def attach_limits(rows: list[Row]) -> None:
    limits = {row.measure.split(":")[0]: row.gbps for row in rows if row.measure.endswith("(limit)")}
    for row in rows:
        if not row.measure.endswith("(limit)"):
            row.limit_gbps = limits.get(row.measure.split(":")[0])


def unregister(copier, region) -> None:
    """Unpin before the pool is unmapped (the driver must not keep a registration of dead pages)."""
    if copier.device.type != "cuda" or not copier.pools.pinned:
        return
    import torch

    torch.cuda.cudart().cudaHostUnregister(copier.pools.get(region).data_ptr())


def machine(opts: Options) -> dict:
    import torch

    out = {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
           "torch": torch.__version__, "shm_free_bytes": shutil.disk_usage(SHM).free}
    if opts.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return out


def print_report(head: dict, result: dict) -> None:
    print(f"command: {head['command']}")
    print(f"machine: {json.dumps(head['machine'])}")
    print(f"pool: {result['pool_bytes'] / 2**30:.2f} GiB on /dev/shm; pinned (cudaHostRegister): "
          f"{'yes' if result['pool_pinned'] else 'no' if head['options']['device'] == 'cuda' else 'n/a (cpu)'}"
          f" in {result['register_s'] * 1e3:.0f} ms; entry {result['entry_bytes'] / 2**10:.0f} KiB, "
          f"{head['options']['num_moved']} blocks per copy")
    print(f"{'measure':<58} {'blocks':<12} {'GB/s':>8} {'limit':>8} {'ratio':>6}")
    for row in result["rows"]:
        limit = f"{row['limit_gbps']:.2f}" if row["limit_gbps"] else "-"
        ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
        print(f"{row['measure']:<58} {row['pattern']:<12} {row['gbps']:>8.2f} {limit:>8} {ratio:>6}")
    for label, ok in result["checks"].items():
        print(f"check: {label}: {'yes' if ok else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import torch
    except ImportError:
        print("no torch: skipped")
        return 0
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    head = {"command": shlex.join([sys.executable, *sys.argv]), "machine": machine(opts),
            "options": {k: getattr(opts, k) for k in opts.__dataclass_fields__}}
    result = run(opts)
    attach_limits(result["rows"])
    result["rows"] = [{**row.__dict__, "ratio": row.ratio} for row in result["rows"]]
    if opts.json:
        print(json.dumps({**head, **result}, indent=2))
    else:
        print_report(head, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
