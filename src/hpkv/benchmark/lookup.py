"""The lookup benchmark: `store.lookup` of one request's prefix in a store that indexes many keys.

What the store holds: `num_keys` keys of 32 random bytes (the shape of vLLM's sha256 block
hashes). Every key is in the storage tier's index, entered directly (`FileIndex.remember`, as
if just written) without writing 16 KiB files a million times:
a lookup that finds a key in the index never touches its file, so the files would change nothing
measured. The first `NUM_DRAM_KEYS` keys of the measured prefix are also committed DRAM entries
(their bytes are never read). The measured prefix is `PREFIX_KEYS` keys: 1,024 DRAM hits, then
3,072 storage hits; the miss variant has an unknown key at position 2,048, where `lookup` stops
(that key costs one `stat`, the tier's check for files other nodes wrote).

The floor beside each figure is a plain dict holding the same keys, probed key by key until the
first miss: the least any Python index can do for the same prefix.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import PoolConfig, StorageConfig
from ..keys import Key, NamespaceDesc, make_key
from ..storage import format as fmt
from ..store import TieredStore, create_store

PREFIX_KEYS = 4096
NUM_DRAM_KEYS = 1024
ENTRY_BYTES = 16 << 10
POOL_BYTES = 32 << 20
WARMUP_ROUNDS = 10
WRITE_THROUGH_WAIT_S = 60.0


@dataclass(frozen=True)
class Latency:
    median_s: float
    p99_s: float


@dataclass(frozen=True)
class LookupTimes:
    num_keys: int
    num_hit: int
    num_dram: int
    hit: Latency
    miss: Latency  # the prefix stops at a miss halfway
    num_miss_hit: int
    hit_floor: Latency
    miss_floor: Latency


def new_keys(num: int) -> list[Key]:
    raw = os.urandom(32 * num)
    return [make_key(raw[i : i + 32]) for i in range(0, len(raw), 32)]


def measure(pool_dir: Path, storage_dir: Path, num_keys: int, rounds: int = 200) -> LookupTimes:
    if num_keys < PREFIX_KEYS:
        raise ValueError(f"a lookup benchmark needs at least {PREFIX_KEYS} keys, got {num_keys}")
    keys = new_keys(num_keys)
    prefix = keys[:PREFIX_KEYS]
    half = PREFIX_KEYS // 2
    stopped = prefix[:half] + new_keys(1) + prefix[half + 1 :]
    desc = NamespaceDesc(
        engine="bench",
        model="lookup",
        dtype="bfloat16",
        layout="blocks",
        block_size=16,
        num_layers=1,
        entry_bytes=ENTRY_BYTES,
    )
    tier_config = StorageConfig(
        path=storage_dir / "lookup",
        enabled=True,
        capacity_bytes=2 * num_keys * (ENTRY_BYTES + 4096),
        fsync="off",
        io_threads=2,
    )
    with create_store(PoolConfig(pool_dir, POOL_BYTES), tier_config) as store:
        ns = store.register(desc)
        _fill(store, ns, keys, prefix[:NUM_DRAM_KEYS])
        found = store.lookup(ns, prefix)
        hit = _latency(lambda: store.lookup(ns, prefix), rounds)
        miss = _latency(lambda: store.lookup(ns, stopped), rounds)
        num_miss_hit = store.lookup(ns, stopped).num_hit
    index = dict.fromkeys(keys)
    return LookupTimes(
        num_keys=num_keys,
        num_hit=found.num_hit,
        num_dram=found.num_dram,
        hit=hit,
        miss=miss,
        num_miss_hit=num_miss_hit,
        hit_floor=_latency(lambda: _prefix_length(index, prefix), rounds),
        miss_floor=_latency(lambda: _prefix_length(index, stopped), rounds),
    )


def _fill(store: TieredStore, ns: str, keys: list[Key], dram_keys: list[Key]) -> None:
    tier = store.storage
    assert tier is not None  # measure() opens the store with storage enabled
    tier.scan_done.wait()  # the scan of the empty directory must not race the entries below
    file_bytes = fmt.header_bytes(len(keys[0])) + ENTRY_BYTES
    for key in keys:
        tier.index.remember(tier.index.key(ns, key), file_bytes)
    store.reserve(ns, dram_keys)
    num_published = store.commit(ns, dram_keys)
    # Each commit queues a write-through that finds the key already on storage and skips it;
    # let those finish so that no write-through thread runs while lookups are timed.
    deadline = time.monotonic() + WRITE_THROUGH_WAIT_S
    while store.counters.write_through_skipped < num_published:
        if time.monotonic() > deadline:
            raise RuntimeError("the DRAM entries' write-throughs did not finish in time")
        time.sleep(0.01)


def _latency(fn, rounds: int) -> Latency:
    for _ in range(WARMUP_ROUNDS):
        fn()
    times_ns = np.empty(rounds, dtype=np.int64)
    for i in range(rounds):
        started = time.perf_counter_ns()
        fn()
        times_ns[i] = time.perf_counter_ns() - started
    return Latency(float(np.median(times_ns)) / 1e9, float(np.percentile(times_ns, 99)) / 1e9)


def _prefix_length(index: dict, keys: list[Key]) -> int:
    num = 0
    for key in keys:
        if key not in index:
            break
        num += 1
    return num
