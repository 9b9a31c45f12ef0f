"""The invariant that matters most, under concurrency and injected I/O faults: a load never
returns bytes other than those committed under that key.

Several threads (writers that sometimes scribble and abort, readers that lease and verify,
a clearer) drive one store whose storage tier fails at random (EIO, ENOSPC, short writes, bits
flipped on the way to disk and back). A full disk (ENOSPC, a short write) is transient here: the
write right after one, on the same thread, finds room. Two in a row would mean the disk really
is full, which teaches the tier to hold only what fits (tests/test_storage_tier.py) and would
shrink this test's tier to one file. Other processes run the same mix on their own pools over
the same storage directory. The pool and the storage capacity are small, so eviction, promotion
and slab moves happen all the time.
"""

from __future__ import annotations

import errno
import hashlib
import multiprocessing
import random
import threading
import time
from pathlib import Path

from helpers.config import make_storage_config
from hpkv.keys import NamespaceDesc, make_key
from hpkv.pool.region import PoolRegion
from hpkv.storage.fileio import FileIO
from hpkv.storage.storage_tier import StorageTier
from hpkv.store import TieredStore

DURATION_S = 6.0
SIZES = (16 << 10, 48 << 10)  # two namespaces with different entry sizes share the pool
NUM_KEYS = 48


class FaultyIO(FileIO):
    """Real system calls, with faults injected at the rate given."""

    def __init__(self, seed: int, rate: float) -> None:
        self.rng = random.Random(seed)
        self.rate = rate
        self.faults = 0
        self._lock = threading.Lock()
        self._full = threading.local()  # whether this thread's last write found the disk full

    def _roll(self) -> float:
        with self._lock:
            return self.rng.random()

    def _fault(self) -> None:
        with self._lock:
            self.faults += 1

    def preadv(self, fd, buffers, offset):
        roll = self._roll()
        if roll < self.rate:
            self._fault()
            raise OSError(errno.EIO, "injected read error")
        n = super().preadv(fd, buffers, offset)
        if roll < 2 * self.rate:  # the medium returned a flipped bit
            self._fault()
            buffers[-1][len(buffers[-1]) // 2] ^= 0x10
        return n

    def pwritev(self, fd, buffers, offset):
        roll = self._roll()
        was_full, self._full.value = getattr(self._full, "value", False), False
        if roll < 2 * self.rate:
            if was_full:  # the retry after a full disk finds room
                return super().pwritev(fd, buffers, offset)
            self._fault()
            self._full.value = True
            if roll < self.rate:
                raise OSError(errno.ENOSPC, "injected full disk")
            return super().pwritev(fd, [buffers[0]], offset)  # short write: no room for the rest
        if roll < 3 * self.rate:
            self._fault()
            corrupted = bytearray(buffers[-1])
            corrupted[-1] ^= 0x01  # silent corruption on the way to disk
            return super().pwritev(fd, [*buffers[:-1], corrupted], offset)
        return super().pwritev(fd, buffers, offset)

    def rename(self, src, dst, dir_fd=None):
        if self._roll() < self.rate:
            self._fault()
            raise OSError(errno.EIO, "injected rename error")
        super().rename(src, dst, dir_fd)


def payload(ns: str, key: bytes, size: int) -> bytes:
    block = hashlib.blake2b(ns.encode() + key).digest()
    return (block * (size // len(block) + 1))[:size]


def descs() -> list[NamespaceDesc]:
    return [
        NamespaceDesc(
            engine="fuzz",
            model=f"m{size}",
            dtype="bfloat16",
            layout="blocks",
            block_size=16,
            num_layers=2,
            entry_bytes=size,
        )
        for size in SIZES
    ]


def all_keys() -> list[bytes]:
    return [make_key(hashlib.sha256(b"fuzz-%d" % i).digest()) for i in range(NUM_KEYS)]


def run_mix(store: TieredStore, seed: int, duration_s: float) -> dict:
    """Writers, readers and a clearer on one store; returns counts and the first violation."""
    ks = all_keys()
    namespaces = [store.register(d) for d in descs()]
    result = {"verified": 0, "violations": [], "dram_hits": 0, "storage_hits": 0}
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s

    def writer(rng: random.Random, owner: int) -> None:
        while time.monotonic() < deadline:
            ns = rng.choice(namespaces)
            size = store.namespaces()[ns].entry_bytes
            start = rng.randrange(NUM_KEYS)
            batch = ks[start : start + rng.randint(1, 6)]
            offsets = store.reserve(ns, batch, owner=owner)
            for key, offset in zip(batch, offsets):
                if offset is not None:
                    store.region.buf[offset : offset + size] = b"\xee" * size  # garbage first
                    if rng.random() < 0.8:
                        store.region.buf[offset : offset + size] = payload(ns, key, size)
            if rng.random() < 0.2 or any(o is not None and store.region.buf[o] == 0xEE for o in offsets):
                store.abort(ns, batch, owner=owner)
            else:
                store.commit(ns, batch, owner=owner)

    def reader(rng: random.Random) -> None:
        while time.monotonic() < deadline:
            ns = rng.choice(namespaces)
            size = store.namespaces()[ns].entry_bytes
            start = rng.randrange(NUM_KEYS)
            batch = ks[start : start + rng.randint(1, 8)]
            hit = store.lookup(ns, batch)
            lease = store.lease(ns, batch, owner=100)
            try:
                num_ready = lease.wait(timeout=30)
                for key, offset in zip(batch[:num_ready], lease.offsets):
                    first = bytes(store.region.buf[offset : offset + size])
                    time.sleep(0)
                    again = bytes(store.region.buf[offset : offset + size])
                    with lock:
                        if first != payload(ns, key, size) or again != first:
                            result["violations"].append(f"key {key.hex()[:12]} in {ns[:8]}: wrong bytes")
                        result["verified"] += 1
            finally:
                store.release(lease.id)
            with lock:
                result["dram_hits"] += hit.num_dram
                result["storage_hits"] += hit.num_storage

    def clearer(rng: random.Random) -> None:
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.2, 0.6))
            store.clear(dram=True, ns=rng.choice([None, *namespaces]))

    threads = [threading.Thread(target=writer, args=(random.Random(seed * 10 + i), i + 1)) for i in range(3)]
    threads += [threading.Thread(target=reader, args=(random.Random(seed * 10 + 5 + i),)) for i in range(3)]
    threads.append(threading.Thread(target=clearer, args=(random.Random(seed * 10 + 9),)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result


def open_faulty_store(pool_dir: Path, storage_dir: Path, seed: int) -> tuple[TieredStore, FaultyIO]:
    io = FaultyIO(seed, rate=0.04)
    region = PoolRegion.create(pool_dir, 2 << 20)
    tier = StorageTier(make_storage_config(storage_dir, capacity_bytes=1200 << 10, io_threads=3), io=io)
    tier.start()
    # 512 KiB slabs: both namespaces compete for 4 slabs, so slabs move between size classes.
    return TieredStore(region, tier, slab_bytes=512 << 10), io


def process_main(pool_dir: str, storage_dir: str, seed: int, queue) -> None:
    store, io = open_faulty_store(Path(pool_dir), Path(storage_dir), seed)
    try:
        result = run_mix(store, seed, DURATION_S)
        result["faults"] = io.faults
    finally:
        store.close()
    queue.put(result)


def test_loads_only_ever_return_committed_bytes(shm_dir, storage_dir, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    others = []
    for seed in (2, 3):
        pool_dir = shm_dir / f"proc{seed}"
        others.append(ctx.Process(target=process_main, args=(str(pool_dir), str(storage_dir), seed, queue)))
    for p in others:
        p.start()

    store, io = open_faulty_store(shm_dir / "main", storage_dir, seed=1)
    try:
        mine = run_mix(store, 1, DURATION_S)
        stats = store.stats()
    finally:
        store.close()
    results = [mine] + [queue.get(timeout=120) for _ in others]
    for p in others:
        p.join(timeout=60)
        assert p.exitcode == 0

    for r in results:
        assert r["violations"] == [], r["violations"][:5]
    assert sum(r["verified"] for r in results) > 200
    assert mine["dram_hits"] > 0 and mine["storage_hits"] > 0
    assert io.faults > 0 and all(r.get("faults", 1) > 0 for r in results)
    assert stats.storage.bad_files > 0  # flipped bits were caught, not served
    assert stats.dram.evictions > 0 and stats.storage.evictions > 0
    # Transient full disks never taught the tier a smaller capacity.
    assert stats.storage.capacity_bytes == 1200 << 10
