"""The data-plane benchmark: DRAM and storage throughput and lookup latency, beside their limits.

Rows, for each entry size, all in one run:
- DRAM write: `reserve` a batch of keys, `np.copyto` each entry from a source array into its
  slot, `commit`. DRAM read: `lease`, `wait`, copy each slot out into a destination array,
  `release`. The store has storage disabled, so no write-through competes. The limit is
  `np.copyto` of the same entries between two plain numpy arrays, in the same loop.
- storage write/read: `StorageTier.write_from` / `read_into` (one checksummed file per entry),
  all submitted at once to the tier's I/O threads. The limit is one thread writing the same bytes
  with `os.write` to one file in the same directory, and reading them back with `os.preadv`.
  Both sides go through the page cache with fsync off; one extra row (at 1 MiB) compares
  `fsync=data` with the same sequential write followed by one `fdatasync`.
- lookup: see `lookup.py`.

Throughputs are payload bytes per second, in GB/s (10^9 bytes). Each figure is the best of
`reps` timed rounds after one untimed warm-up round, for HPKV and its limit alike, which take
turns within each round. Every byte copied or read is checked against its source. The temporary
directories made here are removed here.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import PoolConfig, StorageConfig
from ..errors import HpkvError
from ..keys import Key, NamespaceDesc
from ..pool.slots import SLABS_PER_POOL, SLOT_ALIGN
from ..storage.storage_tier import StorageTier
from ..store import TieredStore, create_store
from ..units import whole_unit_bytes as human_bytes  # the name report.py and storage_peers.py import
from . import lookup, machine
from .machine import disk_limit

GB = 1e9
TARGET_RATIO = 0.7
TARGET_ENTRY_BYTES = 1 << 20
TARGET_LOOKUP_S = 1e-3
BATCH_KEYS = 64  # keys per reserve/commit and per lease: one request's worth of blocks
FSYNC_ROW_MAX_BYTES = 64 << 20  # a synced write of the whole total would dominate the run time
DEFAULT_POOL_PARENT = Path("/dev/shm")


@dataclass(frozen=True)
class BenchConfig:
    entry_sizes: tuple[int, ...] = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
    total_bytes: int = 256 << 20  # bytes moved per entry size and round
    num_lookup_keys: int = 1_000_000
    pool_parent: Path | None = None  # temporaries go under it; None: /dev/shm
    storage_parent: Path | None = None  # None: the current directory (the working disk)
    io_threads: int = 8
    reps: int = 5
    lookup_rounds: int = 200
    fsync_row: bool = True

    def __post_init__(self) -> None:
        if not self.entry_sizes or min(self.entry_sizes) <= 0:
            raise ValueError("give at least one entry size, each greater than 0")
        if self.total_bytes < max(self.entry_sizes):
            raise ValueError(
                f"the total ({self.total_bytes} bytes) must hold at least one entry of "
                f"the largest size ({max(self.entry_sizes)} bytes)"
            )
        if self.num_lookup_keys < lookup.PREFIX_KEYS:
            raise ValueError(f"the lookup needs at least {lookup.PREFIX_KEYS} keys")
        if self.reps < 1 or self.io_threads < 1:
            raise ValueError("reps and io_threads must be at least 1")


@dataclass(frozen=True)
class Row:
    measure: str  # "DRAM write", "storage read", "lookup, all hit", ...
    entry_bytes: int
    unit: str  # "GB/s" (higher is better) or "ms" (lower is better)
    value: float  # HPKV's figure
    limit: float  # the machine's figure for the same work (for lookups: a plain dict's)
    target: str = ""  # empty: no target on this row
    passed: bool | None = None
    p99: float | None = None  # lookups only, in `unit`
    detail: str = ""

    @property
    def ratio(self) -> float | None:
        """HPKV / limit for throughputs (1.0 is the limit); None for latencies."""
        return self.value / self.limit if self.unit == "GB/s" else None


@dataclass(frozen=True)
class Report:
    config: BenchConfig
    machine: machine.Machine
    rows: tuple[Row, ...]
    elapsed_s: float


@dataclass(frozen=True)
class _Buffers:
    """Plain arrays of `total_bytes`: the bytes to save, where they are read back, and the copy
    target of the limit. All touched once before any timing."""

    src: np.ndarray
    dst: np.ndarray
    plain: np.ndarray

    @classmethod
    def allocate(cls, total_bytes: int) -> _Buffers:
        src = np.frombuffer(np.random.default_rng(0).bytes(total_bytes), dtype=np.uint8)
        dst, plain = np.ones(total_bytes, dtype=np.uint8), np.ones(total_bytes, dtype=np.uint8)
        return cls(src, dst, plain)


def run(config: BenchConfig, progress: Callable[[str], None] = lambda message: None) -> Report:
    started = time.monotonic()
    with (
        temporary_dir(config.pool_parent or DEFAULT_POOL_PARENT) as pool_dir,
        temporary_dir(config.storage_parent or Path.cwd()) as storage_dir,
    ):
        where = machine.describe(pool_dir, storage_dir)
        buffers = _Buffers.allocate(config.total_bytes)
        rows: list[Row] = []
        for entry_bytes in config.entry_sizes:
            progress(f"DRAM, {human_bytes(entry_bytes)} entries")
            rows += dram_rows(pool_dir, entry_bytes, buffers, config.reps)
        for entry_bytes in config.entry_sizes:
            progress(f"storage, {human_bytes(entry_bytes)} entries")
            rows += storage_rows(storage_dir, entry_bytes, buffers, config, "off")
        if config.fsync_row:
            entry_bytes = _fsync_entry_bytes(config)
            progress(f"storage with fsync=data, {human_bytes(entry_bytes)} entries")
            rows += storage_rows(storage_dir, entry_bytes, buffers, config, "data")
        progress(f"lookup in {config.num_lookup_keys:,} keys")
        rows += lookup_rows(pool_dir, storage_dir, config)
    return Report(config, where, tuple(rows), time.monotonic() - started)


@contextlib.contextmanager
def temporary_dir(parent: Path) -> Iterator[Path]:
    try:
        path = Path(tempfile.mkdtemp(prefix="hpkv-bench-", dir=parent))
    except OSError as exc:
        raise HpkvError(
            f"cannot create a benchmark directory under {parent}: {exc.strerror}; "
            "choose another with --pool-dir or --storage-dir"
        ) from None
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _desc(entry_bytes: int) -> NamespaceDesc:
    return NamespaceDesc(
        engine="bench",
        model="dataplane",
        dtype="bfloat16",
        layout="blocks",
        block_size=16,
        num_layers=1,
        entry_bytes=entry_bytes,
    )


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / GB


def _check_same(expected: np.ndarray, got: np.ndarray, what: str) -> None:
    if not np.array_equal(expected, got):
        raise RuntimeError(f"{what}: the bytes read back differ from the bytes written")


def _target(entry_bytes: int, ratio: float) -> tuple[str, bool | None]:
    if entry_bytes != TARGET_ENTRY_BYTES:
        return "", None
    return f">= {TARGET_RATIO:.2f}x", ratio >= TARGET_RATIO


def _throughput_row(
    measure: str,
    entry_bytes: int,
    num_bytes: int,
    times_s: list[float],
    limit_s: list[float],
    detail: str = "",
    targeted: bool = True,
) -> Row:
    # The best round of each side: on a shared machine the other rounds measure the neighbours.
    value, limit = _gbps(num_bytes, min(times_s)), _gbps(num_bytes, min(limit_s))
    target, passed = _target(entry_bytes, value / limit) if targeted else ("", None)
    return Row(measure, entry_bytes, "GB/s", value, limit, target, passed, detail=detail)


# -- DRAM -----------------------------------------------------------------------------------


def dram_rows(pool_dir: Path, entry_bytes: int, buffers: _Buffers, reps: int) -> list[Row]:
    num = len(buffers.src) // entry_bytes
    num_bytes = num * entry_bytes
    slot_bytes = -(-entry_bytes // SLOT_ALIGN) * SLOT_ALIGN
    # Room for the working set twice over, and slabs (1/32 of the pool) that hold an entry.
    pool_bytes = max(2 * num * slot_bytes, SLABS_PER_POOL * slot_bytes)
    times: dict[str, list[float]] = {"write": [], "read": [], "limit write": [], "limit read": []}
    with create_store(PoolConfig(pool_dir, pool_bytes), _no_storage(pool_dir)) as store:
        ns = store.register(_desc(entry_bytes))
        # A view of a slice of the map, not of `region.buf` itself, so that `close` can release
        # the region even if an error leaves this array alive in a traceback.
        pool = np.frombuffer(store.region.view(0, pool_bytes), dtype=np.uint8)
        try:
            pool.fill(0)  # first touch of every page, before any timing
            store.region.wait_ready()  # every slot can be handed out (pages reserved in the background)
            # Store and limit take turns within each round, so that other work on the machine
            # weighs on both alike.
            for round_ in range(reps + 1):
                keys = lookup.new_keys(num)
                buffers.dst[:num_bytes].fill(0)  # the last round left the same bytes there
                write_s = _timed(_store_write, store, ns, keys, pool, buffers.src)
                read_s = _timed(_store_read, store, ns, keys, pool, buffers.dst)
                _check_same(buffers.src[:num_bytes], buffers.dst[:num_bytes], "DRAM")
                store.clear(dram=True)
                seconds = (
                    write_s,
                    read_s,
                    _timed(_copy_entries, buffers.plain, buffers.src, entry_bytes, num),
                    _timed(_copy_entries, buffers.dst, buffers.plain, entry_bytes, num),
                )
                if round_:
                    for name, value in zip(times, seconds):
                        times[name].append(value)
        finally:
            del pool
    return [
        _throughput_row("DRAM write", entry_bytes, num_bytes, times["write"], times["limit write"]),
        _throughput_row("DRAM read", entry_bytes, num_bytes, times["read"], times["limit read"]),
    ]


def _no_storage(path: Path) -> StorageConfig:
    return StorageConfig(path=path, enabled=False, capacity_bytes=None, fsync="off", io_threads=1)


def _timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def _store_write(store: TieredStore, ns: str, keys: list[Key], pool: np.ndarray, src: np.ndarray) -> None:
    size = store.namespaces()[ns].entry_bytes
    for first in range(0, len(keys), BATCH_KEYS):
        batch = keys[first : first + BATCH_KEYS]
        for i, offset in enumerate(store.reserve(ns, batch), first):
            if offset is None:
                raise RuntimeError("the benchmark pool had no free slot; it is sized too small")
            np.copyto(pool[offset : offset + size], src[i * size : (i + 1) * size])
        store.commit(ns, batch)


def _store_read(store: TieredStore, ns: str, keys: list[Key], pool: np.ndarray, dst: np.ndarray) -> None:
    size = store.namespaces()[ns].entry_bytes
    for first in range(0, len(keys), BATCH_KEYS):
        batch = keys[first : first + BATCH_KEYS]
        lease = store.lease(ns, batch)
        try:
            if lease.wait() != len(batch):
                raise RuntimeError("a committed benchmark entry was not in DRAM")
            for i, offset in enumerate(lease.offsets, first):
                np.copyto(dst[i * size : (i + 1) * size], pool[offset : offset + size])
        finally:
            store.release(lease.id)


def _copy_entries(dst: np.ndarray, src: np.ndarray, size: int, num: int) -> None:
    for i in range(num):
        np.copyto(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size])


# -- storage --------------------------------------------------------------------------------


def _fsync_entry_bytes(config: BenchConfig) -> int:
    if TARGET_ENTRY_BYTES in config.entry_sizes:
        return TARGET_ENTRY_BYTES
    return sorted(config.entry_sizes)[len(config.entry_sizes) // 2]


def storage_rows(storage_dir: Path, entry_bytes: int, buffers: _Buffers, config: BenchConfig, fsync: str) -> list[Row]:
    total_bytes = len(buffers.src) if fsync == "off" else min(len(buffers.src), FSYNC_ROW_MAX_BYTES)
    num = max(1, total_bytes // entry_bytes)
    num_bytes = num * entry_bytes
    tier = StorageTier(
        StorageConfig(
            path=storage_dir / f"tier-{entry_bytes}-{fsync}",
            enabled=True,
            capacity_bytes=4 * num * (entry_bytes + 4096),
            fsync=fsync,
            io_threads=config.io_threads,
        )
    )
    tier.start()
    desc = _desc(entry_bytes)
    tier.add_namespace(desc.ns, desc.to_json())
    src, dst = buffers.src.data[:num_bytes], buffers.dst.data[:num_bytes]  # memoryviews of the arrays
    times: dict[str, list[float]] = {"write": [], "read": [], "limit write": [], "limit read": []}
    # The same keys every round: the warm-up round creates their fan-out directories, as a tier
    # that has run for a while has them (a fresh tier pays a mkdir or two per entry at first).
    keys = lookup.new_keys(num)
    try:
        for round_ in range(config.reps + 1):
            limit = disk_limit(storage_dir / "limit.bin", src, dst, entry_bytes, fsync)
            write_s = _timed(_tier_write, tier, desc.ns, keys, src)
            buffers.dst[:num_bytes].fill(0)  # the limit's read filled it with the same bytes
            read_s = _timed(_tier_read, tier, desc.ns, keys, dst)
            _check_same(buffers.src[:num_bytes], buffers.dst[:num_bytes], "storage")
            tier.remove(desc.ns)
            if round_:
                for name, seconds in zip(times, (write_s, read_s, *limit)):
                    times[name].append(seconds)
    finally:
        src.release()
        dst.release()
        tier.close()
    if fsync != "off":
        return [
            _throughput_row(
                f"storage write, fsync={fsync}",
                entry_bytes,
                num_bytes,
                times["write"],
                times["limit write"],
                "limit: write + one fdatasync",
                targeted=False,
            )
        ]
    return [
        _throughput_row("storage write", entry_bytes, num_bytes, times["write"], times["limit write"]),
        _throughput_row("storage read", entry_bytes, num_bytes, times["read"], times["limit read"]),
    ]


def _tier_write(tier: StorageTier, ns: str, keys: list[Key], src: memoryview) -> None:
    size = len(src) // len(keys)
    writes = [tier.submit(tier.write_from, ns, key, src[i * size : (i + 1) * size]) for i, key in enumerate(keys)]
    if not all(write.result() for write in writes):
        raise RuntimeError("the storage tier dropped a benchmark write (see the log)")


def _tier_read(tier: StorageTier, ns: str, keys: list[Key], dst: memoryview) -> None:
    size = len(dst) // len(keys)
    reads = [tier.submit(tier.read_into, ns, key, dst[i * size : (i + 1) * size]) for i, key in enumerate(keys)]
    if not all(read.result() for read in reads):
        raise RuntimeError("the storage tier missed a benchmark entry it had written (see the log)")


# -- lookup ---------------------------------------------------------------------------------


def lookup_rows(pool_dir: Path, storage_dir: Path, config: BenchConfig) -> list[Row]:
    times = lookup.measure(pool_dir, storage_dir, config.num_lookup_keys, config.lookup_rounds)
    held = f"{lookup.PREFIX_KEYS:,}-key prefix; store holds {times.num_keys:,} keys ({times.num_dram:,} also in DRAM)"
    hit_ms = times.hit.median_s * 1e3
    return [
        Row(
            "lookup, all hit",
            lookup.ENTRY_BYTES,
            "ms",
            hit_ms,
            times.hit_floor.median_s * 1e3,
            f"<= {TARGET_LOOKUP_S * 1e3:g} ms",
            hit_ms <= TARGET_LOOKUP_S * 1e3,
            p99=times.hit.p99_s * 1e3,
            detail=f"{held}; {times.num_hit:,} hit",
        ),
        Row(
            "lookup, miss halfway",
            lookup.ENTRY_BYTES,
            "ms",
            times.miss.median_s * 1e3,
            times.miss_floor.median_s * 1e3,
            p99=times.miss.p99_s * 1e3,
            detail=f"{held}; {times.num_miss_hit:,} hit, then a miss",
        ),
    ]
