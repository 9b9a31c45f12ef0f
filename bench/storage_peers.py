"""HPKV's storage tier against LMCache's `fs` L2 adapter, on one file system, beside the disk limit.

    python -m bench.storage_peers [--sizes 64k,256k,1m,4m] [--rounds 5] [--in-flight 8]
                                  [--storage-dir DIR] [--cold] [--json]

The peer runs as its own benchmark, `lmcache bench l2 --l2-adapter '{"type":"fs",...}'`, in a
subprocess; HPKV's side is driven here in the same shape, so that both do the same work:

- A round moves `round_bytes` (256 MiB) as `in_flight` x `keys_per_submit` entries of one size.
  LMCache issues `in_flight` submits of `keys_per_submit` keys from one thread; its adapter runs
  one coroutine per submit, which stores (or loads) its keys one after another, each file
  operation on asyncio's default thread pool. So at most `in_flight` files are in flight. HPKV
  gets the same keys submitted one entry at a time to the tier's `in_flight` I/O threads, each
  writing in process (the server's write-through hands its files to writer processes instead,
  `storage/writer.py`): again at most `in_flight` files in flight.
- Every round uses new keys (LMCache's key ranges are per round), so every write creates a new
  file. One untimed warm-up round, then `rounds` timed rounds of writes; then the same rounds read
  back in the same order (LMCache runs its lookups in between, which we do not time). The figure
  is the best round, as in `hpkv.benchmark.dataplane`.
- Page cache: reads follow the writes with nothing in between ("hot"), on both sides, like the
  existing data-plane rows. With `cold`, the dirty pages are synced and the page cache dropped
  (root only) between the write and read phases of each side (LMCache: `--only store`, then
  `--only load` with the same flags, which addresses the same keys).
- Durability: LMCache's fs adapter never fsyncs and, by default, does not use O_DIRECT; it writes
  a temporary and renames it into place. HPKV runs with `fsync=off` (its default) and, as always,
  temporary + rename. HPKV also writes a 52+ byte header and checks an xxh3 checksum on every
  read; LMCache stores raw bytes and checks only the length.
- The limit is `hpkv.benchmark.machine.disk_limit`: one thread writing the round's bytes to one new file in
  the same directory, one entry size per call, then reading them back (best of the same rounds).

Every byte HPKV reads back is compared with its source; LMCache's own `--no-skip-verify` compares
its last round. Between phases, `os.sync()` writes back what the previous phase left dirty, and
each side's files are deleted once it is measured, so neither side pays for the other's writeback
or page cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from bench.harness import configs
from bench.harness.keys import namespace
from bench.harness.report import verdict
from hpkv.benchmark import lookup, machine
from hpkv.benchmark.dataplane import GB, TARGET_ENTRY_BYTES, TARGET_RATIO, human_bytes, temporary_dir
from hpkv.benchmark.machine import disk_limit
from hpkv.config import parse_size
from hpkv.errors import HpkvError
from hpkv.keys import Key
from hpkv.storage.storage_tier import StorageTier

LMCACHE_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class PeerConfig:
    entry_sizes: tuple[int, ...] = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
    round_bytes: int = 256 << 20
    rounds: int = 5
    in_flight: int = 8  # LMCache's --in-flight and HPKV's io_threads (the default HPKV_IO_THREADS)
    storage_parent: Path | None = None  # None: the current directory
    cold: bool = False
    lmcache: str = field(default_factory=lambda: str(Path(sys.executable).with_name("lmcache")))

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.in_flight < 1:
            raise ValueError("rounds and in_flight must be at least 1")
        for size in self.entry_sizes:
            if size % 1024 or self.round_bytes % (size * self.in_flight):
                raise ValueError(
                    f"each entry size must be whole KiB and divide the round "
                    f"({self.round_bytes} bytes) into {self.in_flight} equal submits"
                )

    def keys_per_submit(self, entry_bytes: int) -> int:
        return self.round_bytes // entry_bytes // self.in_flight


@dataclass(frozen=True)
class PeerRow:
    entry_bytes: int
    direction: str  # "write" or "read"
    hpkv: float  # GB/s
    lmcache: float
    limit: float
    detail: str = ""

    @property
    def vs_peer(self) -> float:
        return self.hpkv / self.lmcache

    @property
    def vs_limit(self) -> float:
        return self.hpkv / self.limit

    @property
    def target(self) -> str:
        beside = f", >= {TARGET_RATIO:.1f}x limit" if self.entry_bytes == TARGET_ENTRY_BYTES else ""
        return f">= LMCache{beside}"

    @property
    def passed(self) -> bool:
        at_limit = self.entry_bytes != TARGET_ENTRY_BYTES or self.vs_limit >= TARGET_RATIO
        return self.vs_peer >= 1.0 and at_limit


@dataclass(frozen=True)
class PeerReport:
    config: PeerConfig
    machine: dict[str, object]
    rows: tuple[PeerRow, ...]
    elapsed_s: float
    file_costs: dict[str, float] = field(default_factory=dict)  # see `file_costs`


def run(config: PeerConfig, progress: Callable[[str], None] = lambda message: None) -> PeerReport:
    if config.cold and os.geteuid() != 0:
        raise HpkvError("--cold drops the page cache, which needs root")
    started = time.monotonic()
    with temporary_dir(config.storage_parent or Path.cwd()) as root:
        where = machine.describe(root, root)
        src = np.frombuffer(np.random.default_rng(0).bytes(config.round_bytes), dtype=np.uint8)
        dst = np.ones(config.round_bytes, dtype=np.uint8)
        rows: list[PeerRow] = []
        progress("per-file costs of the file system")
        costs = file_costs(root)
        for entry_bytes in config.entry_sizes:
            progress(f"{human_bytes(entry_bytes)} entries: disk limit")
            limit = measure_limit(root, memoryview(src), memoryview(dst), entry_bytes, config)
            # Each side's files go as soon as it is measured, so that both run with the same page
            # cache and free memory (the second would otherwise reclaim the first's pages).
            progress(f"{human_bytes(entry_bytes)} entries: lmcache bench l2 (fs)")
            peer = measure_lmcache(root / f"lmcache-{entry_bytes}", entry_bytes, config)
            shutil.rmtree(root / f"lmcache-{entry_bytes}", ignore_errors=True)
            progress(f"{human_bytes(entry_bytes)} entries: HPKV storage tier")
            hpkv = measure_hpkv(root / f"hpkv-{entry_bytes}", src, dst, entry_bytes, config)
            shutil.rmtree(root / f"hpkv-{entry_bytes}", ignore_errors=True)
            num_bytes = config.round_bytes
            for i, direction in enumerate(("write", "read")):
                rows.append(
                    PeerRow(
                        entry_bytes,
                        direction,
                        _gbps(num_bytes, hpkv[i]),
                        _gbps(num_bytes, peer[i]),
                        _gbps(num_bytes, limit[i]),
                    )
                )
    return PeerReport(config, where, tuple(rows), time.monotonic() - started, costs)


def file_costs(root: Path, num_files: int = 500) -> dict[str, float]:
    """What one file costs this file system, whatever is in it: creating `num_files` empty files
    and then removing them, on one thread; microseconds per file, wall and system CPU. Every
    entry of both sides pays one create (and the limit, one file per round, does not), so this
    is the floor under the per-file part of both sides' times."""
    work = root / "file-costs"
    work.mkdir()
    try:
        paths = [str(work / f"f{i}") for i in range(num_files)]
        times = [(time.perf_counter(), _system_s())]
        for path in paths:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        times.append((time.perf_counter(), _system_s()))
        for path in paths:
            os.unlink(path)
        times.append((time.perf_counter(), _system_s()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    per_file = [((b[0] - a[0]) / num_files * 1e6, (b[1] - a[1]) / num_files * 1e6) for a, b in pairwise(times)]
    return {
        "create_us": per_file[0][0],
        "create_system_us": per_file[0][1],
        "unlink_us": per_file[1][0],
        "unlink_system_us": per_file[1][1],
        "files": num_files,
    }


def _system_s() -> float:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_stime


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / GB


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
        f.write("3\n")


# -- the disk limit --------------------------------------------------------------------------


def measure_limit(
    root: Path, src: memoryview, dst: memoryview, entry_bytes: int, config: PeerConfig
) -> tuple[float, float]:
    """Best (write_s, read_s) of `rounds` timed rounds after a warm-up, as `dataplane` measures it.
    Cold: the page cache is synced and dropped between the write and the read."""
    writes, reads = [], []
    os.sync()
    for round_ in range(config.rounds + 1):
        write_s, read_s = disk_limit(
            root / "limit.bin", src, dst, entry_bytes, "off", between=drop_page_cache if config.cold else None
        )
        if round_:
            writes.append(write_s)
            reads.append(read_s)
    return min(writes), min(reads)


# -- LMCache ---------------------------------------------------------------------------------


def lmcache_command(base_path: Path, entry_bytes: int, config: PeerConfig, only: str | None, output: Path) -> list[str]:
    adapter = json.dumps({"type": "fs", "base_path": str(base_path)})
    command = [
        config.lmcache,
        "bench",
        "l2",
        "--l2-adapter",
        adapter,
        "--data-size-kb",
        str(entry_bytes // 1024),
        "--num-keys",
        str(config.keys_per_submit(entry_bytes)),
        "--in-flight",
        str(config.in_flight),
        "--rounds",
        str(config.rounds),
        "--warmup-rounds",
        "1",
        "--no-skip-verify",
        "--format",
        "json",
        "--output",
        str(output),
        "-q",
    ]
    return command + (["--only", only] if only else [])


def measure_lmcache(base_path: Path, entry_bytes: int, config: PeerConfig) -> tuple[float, float]:
    """Best (store_s, load_s) round of `lmcache bench l2` with the fs adapter."""
    if not Path(config.lmcache).exists():
        raise HpkvError(
            f"{config.lmcache} not found: install lmcache (and aiofiles) in this "
            "environment, or name its `lmcache` command with --lmcache"
        )
    os.sync()
    if not config.cold:
        ops = _run_lmcache(base_path, entry_bytes, config, None)
    else:
        ops = _run_lmcache(base_path, entry_bytes, config, "store")
        drop_page_cache()
        ops.update(_run_lmcache(base_path, entry_bytes, config, "load"))
    return ops["Store"], ops["Load"]


def _run_lmcache(base_path: Path, entry_bytes: int, config: PeerConfig, only: str | None) -> dict[str, float]:
    output = base_path.with_name(base_path.name + f"-{only or 'all'}.json")
    command = lmcache_command(base_path, entry_bytes, config, only, output)
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LMCACHE_TIMEOUT_S)
    if done.returncode != 0:
        raise HpkvError(f"lmcache bench l2 failed (exit {done.returncode}): {done.stderr[-2000:]}")
    metrics = json.loads(output.read_text())["metrics"]
    output.unlink()
    best: dict[str, float] = {}
    for section in metrics.values():
        name = section.get("operation") if isinstance(section, dict) else None
        if name in ("Store", "Load"):
            if section["total_success"] != section["total_keys"] or section["rounds_timed_out"]:
                raise HpkvError(
                    f"lmcache bench l2: {name} moved {section['total_success']} of "
                    f"{section['total_keys']} keys ({section['rounds_timed_out']} rounds timed out)"
                )
            best[name] = section["duration_min_ms"] / 1e3
    return best


# -- HPKV ------------------------------------------------------------------------------------


def measure_hpkv(
    path: Path, src: np.ndarray, dst: np.ndarray, entry_bytes: int, config: PeerConfig
) -> tuple[float, float]:
    """Best (write_s, read_s) round of the storage tier, driven as `lmcache bench l2` drives its
    adapter: new keys every round, all writes first, then the reads in the same order."""
    num = config.round_bytes // entry_bytes
    total_rounds = config.rounds + 1
    tier = StorageTier(
        configs.storage(path, capacity_bytes=2 * total_rounds * num * (entry_bytes + 4096), io_threads=config.in_flight)
    )
    tier.start()
    tier.scan_done.wait()
    desc = namespace("storage-peers", entry_bytes, dtype="bfloat16", block_size=16, num_layers=1)
    tier.add_namespace(desc.ns, desc.to_json())
    src_view, dst_view = memoryview(src), memoryview(dst)
    rounds = [lookup.new_keys(num) for _ in range(total_rounds)]
    try:
        os.sync()
        writes = [_timed_round(tier.write_from, tier, desc.ns, keys, src_view, entry_bytes) for keys in rounds]
        if config.cold:
            drop_page_cache()
        reads = []
        for keys in rounds:
            dst.fill(0)
            reads.append(_timed_round(tier.read_into, tier, desc.ns, keys, dst_view, entry_bytes))
            if not np.array_equal(src, dst):
                raise RuntimeError("HPKV storage: the bytes read back differ from the bytes written")
    finally:
        src_view.release()
        dst_view.release()
        tier.close()
    return min(writes[1:]), min(reads[1:])


def _timed_round(op, tier: StorageTier, ns: str, keys: list[Key], buf: memoryview, size: int) -> float:
    started = time.perf_counter()
    done = [tier.submit(op, ns, key, buf[i * size : (i + 1) * size]) for i, key in enumerate(keys)]
    if not all(future.result() for future in done):
        raise RuntimeError(f"HPKV storage: {op.__name__} failed for a benchmark entry (see the log)")
    return time.perf_counter() - started


# -- the command line ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64k,256k,1m,4m", help="entry sizes, comma-separated")
    parser.add_argument("--round", default="256m", help="bytes moved per round and entry size")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up); the best counts")
    parser.add_argument(
        "--in-flight", type=int, default=8, help="LMCache's --in-flight and HPKV's I/O threads (HPKV_IO_THREADS)"
    )
    parser.add_argument(
        "--storage-dir",
        type=Path,
        default=None,
        help="parent of the temporaries of both sides (default: the current directory)",
    )
    parser.add_argument(
        "--cold", action="store_true", help="sync and drop the page cache between writes and reads (root only)"
    )
    parser.add_argument("--lmcache", default=None, help="the lmcache command (default: beside this python)")
    parser.add_argument("--json", action="store_true", help="JSON on stdout")
    parser.add_argument(
        "--table-from",
        type=Path,
        default=None,
        metavar="JSON",
        help="print the table of a run saved with --json, and measure nothing",
    )
    args = parser.parse_args(argv)
    if args.table_from:
        print_table(from_json(args.table_from.read_text()), Console(width=160))
        return 0
    extra = {"lmcache": args.lmcache} if args.lmcache else {}
    config = PeerConfig(
        entry_sizes=tuple(parse_size(s) for s in args.sizes.split(",")),
        round_bytes=parse_size(args.round),
        rounds=args.rounds,
        in_flight=args.in_flight,
        storage_parent=args.storage_dir,
        cold=args.cold,
        **extra,
    )
    err = Console(stderr=True)
    report = run(config, lambda message: err.print(f"measuring {message}..."))
    if args.json:
        print(to_json(report))
    else:
        print_table(report, Console(width=160))
    return 0


def to_json(report: PeerReport) -> str:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(report.config).items()}
    rows = [
        {
            **dataclasses.asdict(row),
            "vs_peer": row.vs_peer,
            "vs_limit": row.vs_limit,
            "target": row.target,
            "passed": row.passed,
        }
        for row in report.rows
    ]
    return json.dumps(
        {
            "config": config,
            "machine": report.machine,
            "rows": rows,
            "elapsed_s": round(report.elapsed_s, 1),
            "file_costs": report.file_costs,
        },
        indent=2,
    )


def from_json(text: str) -> PeerReport:
    doc = json.loads(text)
    fields = {f.name for f in dataclasses.fields(PeerRow)}
    config = {**doc["config"], "entry_sizes": tuple(doc["config"]["entry_sizes"])}
    if config["storage_parent"] is not None:
        config["storage_parent"] = Path(config["storage_parent"])
    rows = tuple(PeerRow(**{k: v for k, v in row.items() if k in fields}) for row in doc["rows"])
    return PeerReport(PeerConfig(**config), doc["machine"], rows, doc["elapsed_s"], doc.get("file_costs", {}))


def print_table(report: PeerReport, console: Console) -> None:
    m = report.machine
    table = Table(title=Text(f"HPKV storage tier vs LMCache fs adapter ({m['cpus']} CPUs, load {m['load_avg_1m']})"))
    for name in ("entry", "op", "HPKV", "LMCache fs", "disk limit", "HPKV/LMCache", "HPKV/limit", "target", "result"):
        table.add_column(name, justify="left" if name in ("op", "target", "result") else "right", no_wrap=True)
    for row in report.rows:
        result = Text(verdict(row.passed), style="green" if row.passed else "bold red")
        table.add_row(
            human_bytes(row.entry_bytes),
            row.direction,
            f"{row.hpkv:.2f} GB/s",
            f"{row.lmcache:.2f} GB/s",
            f"{row.limit:.2f} GB/s",
            f"{row.vs_peer:.2f}x",
            f"{row.vs_limit:.2f}x",
            row.target,
            result,
        )
    console.print(table)
    c = report.config
    storage = m["storage_dir"]
    console.print(
        Text(
            f"both on {storage['fs_type']} ({storage['path']}); page cache: "
            f"{'dropped between writes and reads' if c.cold else 'reads right after writes'}; fsync off, "
            f"no O_DIRECT on both sides; {c.in_flight} in flight; {human_bytes(c.round_bytes)} per round, "
            f"new keys each round; best of {c.rounds} rounds after 1 warm-up; GB/s = 10^9 bytes/s; "
            f"{report.elapsed_s:.0f} s in all"
        )
    )
    f = report.file_costs
    if f:
        console.print(
            Text(
                f"per file on this file system (one thread, {f['files']} empty files): create {f['create_us']:.0f} us "
                f"({f['create_system_us']:.0f} us of system CPU), unlink {f['unlink_us']:.0f} us "
                f"({f['unlink_system_us']:.0f} us); every entry written pays one create, the limit's one file does not"
            )
        )


if __name__ == "__main__":
    sys.exit(main())
