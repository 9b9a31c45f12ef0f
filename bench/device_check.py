"""Device check: HPKV's block copies between a GPU's paged KV cache and the pinned DRAM pool.

    python -m bench.device_check [--json] [--device cpu]

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
5. a server restart under a running worker (`--restarts`, 2 by default): a real HPKV server
   (`python -m hpkv.server.daemon`, storage off) in a fresh directory under /dev/shm, a client
   that copies through a `BlockCopier` (save under a reservation, load under a lease) in every
   server generation; after the last, exactly one pool must be registered (cudaHostRegister, piece
   by piece) and mapped: every old one unregistered and unmapped once its handles were gone.

6. worker registration against pool size (`--register-gib`, 1,4,16 by default, as far as
   /dev/shm has room): a fresh pool attached as a worker attaches it, the time `PoolTensors`
   takes to hand it out (what a worker's first copy waits for: registration runs in pieces in
   the background) and the time until every piece is registered; the slopes per GiB.
The copy rows of step 3 are measured once the pool is registered whole.

Without CUDA it prints "no CUDA device: skipped" and exits 0. `--device cpu` runs the same logic
with a CPU "device" (no pinning; the restart check counts registrations with a stand-in), to test
the script itself; `--restart-only` runs step 5 alone. Figures are GB/s (10^9 bytes/s), the
median of `--reps` timed rounds after one warm-up round. Only the checks are asserted (exit 1
when one fails).
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

from bench.harness.server import start_server, stop_server

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
    restarts: int = 2  # server restarts under a running worker (step 5); 0: none
    restart_only: bool = False
    register_gib: tuple[float, ...] = (1.0, 4.0, 16.0)  # pool sizes of the registration step


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
    p.add_argument("--restarts", type=int, default=2, help="server restarts under a running worker (0: skip)")
    p.add_argument("--restart-only", action="store_true", help="only the restart check")
    p.add_argument("--register-gib", default="1,4,16", help="pool sizes of the registration step ('': skip)")
    a = p.parse_args(argv)
    return Options(
        a.device,
        int(a.pool_gib * 2**30),
        a.layers,
        a.page_bytes,
        a.kv_blocks,
        min(a.blocks, a.kv_blocks // 2),
        a.reps,
        a.json,
        a.restarts,
        a.restart_only,
        tuple(float(x) for x in a.register_gib.split(",") if x),
    )


def pool_size(opts: Options, slot_bytes: int) -> int:
    """What /dev/shm can take (half its free room at most), whole slots, at least the blocks moved."""
    free = shutil.disk_usage(SHM).free
    size = min(opts.pool_bytes, free // 2)
    size -= size % (1 << 20)
    if size < opts.num_moved * slot_bytes:
        raise SystemExit(
            f"/dev/shm has {free / 2**20:.0f} MiB free: too little for {opts.num_moved} entries of "
            f"{slot_bytes / 2**10:.0f} KiB; use --blocks or --layers to shrink the check"
        )
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
        views = [
            torch.randint(
                -128, 128, (opts.num_blocks, opts.page_bytes), dtype=torch.int8, device=device, generator=fill
            )
            for _ in range(opts.num_layers)
        ]
        copier = BlockCopier(views, tuple(i * opts.page_bytes for i in range(opts.num_layers)))
        started = time.perf_counter()
        _, pieces = copier.pools.get_pieces(region)  # as the worker's first copy: registration starts
        attach_s = time.perf_counter() - started
        if pieces is not None:
            pieces.wait_idle()  # the copies below are measured against a pool registered whole
        register_s = time.perf_counter() - started
        rows, checks = copier_rows(opts, copier, region, slot_bytes, sync, gen)
        rows += limit_rows(opts, views, slot_bytes, sync, gen)
        pinned = pieces is not None and pieces.registered_bytes() == size
        copier.pools.close()  # unpinned before the pool is unmapped: no registration of dead pages
        del copier, views
        gc.collect()  # the pool's tensor views must be gone before it is unmapped
        return {
            "pool_bytes": size,
            "pool_pinned": pinned,
            "attach_s": attach_s,
            "register_s": register_s,
            "entry_bytes": entry_bytes,
            "rows": rows,
            "checks": checks,
        }
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
        save_s = timed(lambda src=src: copier.save(region, src, offsets), opts.reps, sync)
        load_s = timed(lambda dst=dst: copier.load(region, dst, offsets), opts.reps, sync)
        checks[f"{pattern}: loaded blocks equal the saved blocks"] = all(
            torch.equal(v[dst], v[src]) for v in copier.layer_views
        )
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
    limit = {
        "save": gbps(num_bytes, timed(lambda: host[:num_bytes].copy_(device, non_blocking=pin), opts.reps, sync)),
        "load": gbps(num_bytes, timed(lambda: device.copy_(host[:num_bytes], non_blocking=pin), opts.reps, sync)),
    }
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

    per_page = {
        "save": gbps(num_bytes, timed(lambda: pages(True), opts.reps, sync)),
        "load": gbps(num_bytes, timed(lambda: pages(False), opts.reps, sync)),
    }
    kind = "pinned" if pin else "plain"
    return [Row(f"{d}: one {kind} copy_ of the same bytes (limit)", "contiguous", limit[d], None) for d in limit] + [
        Row(f"{d}: per-page copy_, non_blocking, torch {kind} buffer", "random", per_page[d], None) for d in per_page
    ]


def attach_limits(rows: list[Row]) -> None:
    limits = {row.measure.split(":")[0]: row.gbps for row in rows if row.measure.endswith("(limit)")}
    for row in rows:
        if not row.measure.endswith("(limit)"):
            row.limit_gbps = limits.get(row.measure.split(":")[0])


class CountingPinning:
    """Counts the registrations (one per piece of a pool mapping) a `PoolTensors` makes and ends,
    and keeps the addresses still registered; delegates to CUDA's, if given."""

    def __init__(self, inner=None) -> None:
        self.inner = inner
        self.num_registered = self.num_unregistered = 0
        self.live: set[int] = set()

    def register(self, address: int, nbytes: int) -> bool:
        self.num_registered += 1
        self.live.add(address)
        return self.inner.register(address, nbytes) if self.inner is not None else True

    def unregister(self, address: int, nbytes: int) -> None:
        self.num_unregistered += 1
        self.live.discard(address)
        if self.inner is not None:
            self.inner.unregister(address, nbytes)


def registration_scale(opts: Options) -> dict:
    """Step 6: a worker's registration against pool size: how long handing the pool out takes
    (what a worker's first copy waits for) and how long registering it whole takes in the
    background, pools of `--register-gib` (those /dev/shm has room for). On the CPU the
    registration is `LockPinning` (mlock), to test the script itself."""
    import torch

    from hpkv.pool.region import PoolRegion
    from hpkv.transfer.blocks import PoolTensors
    from hpkv.transfer.pinning import CudaPinning, LockPinning

    rows, skipped = [], []
    for gib in opts.register_gib:
        size = int(gib * 2**30)
        if size > shutil.disk_usage(SHM).free // 2:
            skipped.append(gib)
            continue
        pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-device-register-", dir=SHM))
        server = client = None
        try:
            server = PoolRegion.create(pool_dir, size)
            server.wait_ready()  # the pool's pages in place, as under a running server
            client = PoolRegion.attach(os.dup(server.share_fd()), size, server.path)
            device = torch.device(opts.device)
            tensors = PoolTensors(device, CudaPinning(device) if device.type == "cuda" else LockPinning())
            started = time.perf_counter()
            _, pieces = tensors.get_pieces(client)
            handed_out = time.perf_counter() - started
            assert pieces is not None
            pieces.wait_idle()
            registered = time.perf_counter() - started
            whole = pieces.registered_bytes() == size
            tensors.close()
            del pieces, tensors
            gc.collect()
            rows.append(
                {"pool_gib": gib, "handed_out_ms": handed_out * 1e3, "registered_s": registered, "whole": whole}
            )
        finally:
            for region in (client, server):
                if region is not None:
                    region.close()
            shutil.rmtree(pool_dir, ignore_errors=True)
    out: dict = {"registration": rows, "registration_skipped": skipped, "checks": {}}
    if len(rows) >= 2:
        first, last = rows[0], rows[-1]
        span = last["pool_gib"] - first["pool_gib"]
        out["registration_slope"] = {
            "handed_out_ms_per_gib": (last["handed_out_ms"] - first["handed_out_ms"]) / span,
            "registered_s_per_gib": (last["registered_s"] - first["registered_s"]) / span,
        }
    for row in rows:
        out["checks"][f"registration: a {row['pool_gib']:g} GiB pool handed out within 100 ms"] = (
            row["handed_out_ms"] < 100
        )
        out["checks"][f"registration: a {row['pool_gib']:g} GiB pool registered whole"] = row["whole"]
    return out


def pool_mappings(directory: Path) -> int:
    """This process's mappings of `directory`'s pool files, removed ones too."""
    with open("/proc/self/maps") as f:
        return sum(f"{directory}/hpkv.pool" in line for line in f)


def restart_check(opts: Options) -> dict:
    """Step 5: save and load through a live client in every server generation; after the
    restarts, one pool registered and mapped."""
    import torch

    import hpkv
    from hpkv.keys import NamespaceDesc, make_key
    from hpkv.server.autostart import ServerUnavailable
    from hpkv.server.client import Client
    from hpkv.transfer.blocks import BlockCopier
    from hpkv.transfer.pinning import CudaPinning

    device = torch.device(opts.device)
    entry_bytes = opts.num_layers * opts.page_bytes
    slot_bytes = -(-entry_bytes // SLOT_ALIGN) * SLOT_ALIGN
    pool_bytes = max(64 << 20, 4 * opts.num_moved * slot_bytes)  # room for one generation's saves, and slabs
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-device-restart-", dir=SHM))
    src_root = str(Path(hpkv.__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPKV_", "VLLM_HPKV"))}
    env.update(
        HPKV_SHARE_MEM_FILE_PATH=str(pool_dir),
        HPKV_KV_MEM_POOL_SIZE=str(pool_bytes),
        HPKV_KV_STORAGE_ENABLE="false",
        HPKV_CONFIG_FILE_PATH=str(pool_dir / "no-config.ini"),
        PYTHONPATH=os.pathsep.join(filter(None, [src_root, os.environ.get("PYTHONPATH")])),
    )
    gen = torch.Generator(device="cpu").manual_seed(1)
    fill = torch.Generator(device=device).manual_seed(1)
    views = [
        torch.randint(-128, 128, (opts.num_blocks, opts.page_bytes), dtype=torch.int8, device=device, generator=fill)
        for _ in range(opts.num_layers)
    ]
    pinning = CountingPinning(CudaPinning(device) if device.type == "cuda" else None)
    copier = BlockCopier(views, tuple(i * opts.page_bytes for i in range(opts.num_layers)), pinning=pinning)
    log_path = pool_dir / "servers.log"
    server = start_server(env, log_path)
    client = Client(pool_dir, "device-check", autostart=False, prefault=True, retry_interval_s=0.05)
    same, restart_s = True, []
    try:
        ns = client.register(
            NamespaceDesc(
                engine="device-check",
                model="fake",
                dtype="int8",
                layout="blocks",
                block_size=32,
                num_layers=opts.num_layers,
                entry_bytes=entry_bytes,
            )
        )
        for generation in range(opts.restarts + 1):
            if generation:
                started = time.perf_counter()
                stop_server(server)
                server = start_server(env, log_path)
                while True:
                    try:
                        client.stats()
                        break
                    except ServerUnavailable:
                        time.sleep(0.05)
                restart_s.append(time.perf_counter() - started)
            ids = torch.randperm(opts.num_blocks, generator=gen)[: 2 * opts.num_moved].tolist()
            src, dst = ids[: opts.num_moved], ids[opts.num_moved :]
            keys = [make_key(f"{generation}-{i}".encode()) for i in range(opts.num_moved)]
            res = client.reserve(ns, keys)
            if None in res.offsets:
                raise SystemExit(f"the pool of {pool_bytes} bytes had no room for {opts.num_moved} entries")
            copier.save(res.region, src, res.offsets)
            client.commit(res)
            lease = client.lease(ns, keys)
            ready = client.wait(lease, timeout_s=30)
            copier.load(lease.region, dst, lease.offsets)
            pieces = copier.pools.get_pieces(lease.region)[1]
            pieces.wait_idle(60)  # every piece of this generation's pool registered
            same = same and ready == opts.num_moved and all(torch.equal(v[dst], v[src]) for v in views)
            client.release(lease)
            del res, lease
        gc.collect()
        held, mapped = copier.pools.num_held(), pool_mappings(pool_dir)
        registered, unregistered = pinning.num_registered, pinning.num_unregistered
        last = {pieces.address + p * pieces.piece_bytes for p in pieces.order}  # the live pool's
        only_last = pinning.live == last and unregistered == registered - len(last)
    finally:
        client.close()
        stop_server(server)
        copier.pools.close()
        del copier, views
        gc.collect()
        shutil.rmtree(pool_dir, ignore_errors=True)
    restarts = opts.restarts
    return {
        "restart_s": restart_s,
        "registered": registered,
        "unregistered": unregistered,
        "checks": {
            f"restart: loaded blocks equal the saved ones in each of {restarts + 1} server generations": same,
            f"restart: 1 pool held and registered after {restarts} restarts, every piece of the old ones "
            f"unregistered (got {held} held; {registered} pieces registered, {unregistered} unregistered, "
            f"{len(last)} in the live pool)": held == 1 and only_last,
            f"restart: 1 pool mapped after {restarts} restarts (got {mapped})": mapped == 1,
        },
    }


def machine(opts: Options) -> dict:
    import torch

    out = {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "shm_free_bytes": shutil.disk_usage(SHM).free,
    }
    if opts.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return out


def print_report(head: dict, result: dict) -> None:
    print(f"command: {head['command']}")
    print(f"machine: {json.dumps(head['machine'])}")
    if "rows" not in result:  # --restart-only
        print_restart(result)
        return
    print(
        f"pool: {result['pool_bytes'] / 2**30:.2f} GiB on /dev/shm; pinned (cudaHostRegister): "
        f"{'yes' if result['pool_pinned'] else 'no' if head['options']['device'] == 'cuda' else 'n/a (cpu)'}"
        f" (handed out in {result['attach_s'] * 1e3:.1f} ms, registered whole in the background after "
        f"{result['register_s'] * 1e3:.0f} ms); entry {result['entry_bytes'] / 2**10:.0f} KiB, "
        f"{head['options']['num_moved']} blocks per copy"
    )
    print(f"{'measure':<58} {'blocks':<12} {'GB/s':>8} {'limit':>8} {'ratio':>6}")
    for row in result["rows"]:
        limit = f"{row['limit_gbps']:.2f}" if row["limit_gbps"] else "-"
        ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
        print(f"{row['measure']:<58} {row['pattern']:<12} {row['gbps']:>8.2f} {limit:>8} {ratio:>6}")
    print_restart(result)


def print_scale(result: dict) -> None:
    for row in result.get("registration", []):
        print(
            f"registration, pool {row['pool_gib']:g} GiB: handed out in {row['handed_out_ms']:.1f} ms, "
            f"registered whole in the background after {row['registered_s']:.2f} s"
        )
    if result.get("registration_slope"):
        slope = result["registration_slope"]
        print(
            f"registration slope: {slope['handed_out_ms_per_gib']:+.2f} ms/GiB handed out (what a worker's "
            f"start waits for), {slope['registered_s_per_gib']:.3f} s/GiB in the background"
        )
    for gib in result.get("registration_skipped", []):
        print(f"registration, pool {gib:g} GiB: skipped (/dev/shm has too little room)")


def print_restart(result: dict) -> None:
    print_scale(result)
    if result.get("restart_s"):
        print(
            f"server restarts under a running worker: {len(result['restart_s'])}, each "
            f"{statistics.median(result['restart_s']):.1f} s (median) until the client was back"
        )
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
    head = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": machine(opts),
        "options": {k: getattr(opts, k) for k in opts.__dataclass_fields__},
    }
    result = {"checks": {}} if opts.restart_only else run(opts)
    if not opts.restart_only:
        attach_limits(result["rows"])
        result["rows"] = [{**row.__dict__, "ratio": row.ratio} for row in result["rows"]]
    if opts.register_gib and not opts.restart_only:
        scale = registration_scale(opts)
        result["checks"].update(scale.pop("checks"))
        result.update(scale)
    if opts.restarts:
        restart = restart_check(opts)
        result["checks"].update(restart.pop("checks"))
        result.update(restart)
    if opts.json:
        print(json.dumps({**head, **result}, indent=2))
    else:
        print_report(head, result)
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
