"""Costs that grow with work: index memory per million entries, lookup with 10 million storage
entries indexed, and the write-through's CPU per GiB against the floor of the same work.

- DRAM index: a real server (storage off, a 4 GiB pool of 4 KiB slots); its anonymous resident
  memory (RssAnon: the pool's pages are shared memory, not counted) before and after a client
  reserves and commits 1,000,000 entries, per million.
- Storage index: the store's storage tier (`create_store`, an empty directory), its index
  given `--storage-entries` entries (10 million) the way the start-up scan adds the files it
  finds (`FileIndex.add_scanned`, 32-byte engine keys); this process's resident memory before and
  after, per million; then a 4,096-key prefix lookup (`TieredStore.lookup`, all storage hits),
  median and p99, against the same lookup measured with 4,096 entries indexed, in the same run.
- Write-through: a real server writing 1 GiB of entries (`--entry-mib`: 1 and 4 MiB) to storage
  on disk, after a warm-up that starts its write-through processes and makes the storage tree's
  directories the keys fall in (a tree in use has them); CPU seconds per GiB of the server process
  and of its write-through processes, in two phases: the first GiB through a fresh 1 GiB pool
  (each write-through process then faults in every 4 KiB page of the pool it reads, once), and a
  GiB after two more passes over the pool (a pool in use). Each against the floor measured in the
  same rounds (8 of 128 MiB, the server's writes then the floor's, so that both meet the same
  machine): the checksum the file format takes (xxh3-64 of the payload) and a write of the same
  bytes, from as many distinct addresses in memory as the pool's, into new files in the page
  cache of the same file system (kept until the end: ext4 without a journal makes a new file
  slower for every file removed in the last seconds). Target: within 1.5x of the floor. What is not write-through work
  is measured apart and shown: the server's handling of the same puts (reserve, commit) in a
  server with storage off, and its CPU for the benchmark's stats polls (one second of them alone,
  scaled to their number).

    python -m bench.index_costs [--storage-entries 10000000] [--entry-mib 1 4] [--storage-dir DIR]
                               [--write-through-only] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import xxhash

from bench.harness import configs
from bench.harness.keys import keys as _keys
from bench.harness.keys import namespace
from bench.harness.report import log, median_p99_ms, timed, verdict
from bench.harness.server import SHM, huge_tmpfs, server_env, start_server, stop_server
from hpkv.server.client import Client
from hpkv.store import create_store

MiB, GiB = 1 << 20, 1 << 30
TARGET_WRITE_RATIO = 1.5
ROUNDS = 8  # of the write-through measurement, each followed by its share of the floor
POOL_BYTES = GiB  # the write-through server's pool
WARM_PASSES = 2  # more passes over the pool before the "in use" phase
# The first GiB through a fresh server's pool, then one through a pool in use: a write-through
# process faults in each 4 KiB page of its mapping of the pool once, on its first read of it.
PHASES = ("first pass", "pool in use")


def rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
    return 0


def dram_index(num_entries: int = 1_000_000) -> dict:
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-costs-", dir=SHM))
    env = server_env(pool_dir, pool_dir / "storage", HPKV_KV_MEM_POOL_SIZE="4g", HPKV_KV_STORAGE_ENABLE="0")
    try:
        proc = start_server(env)
        try:
            with Client(pool_dir, kind="bench-costs", autostart=False) as client:
                ns = client.register(namespace("costs-dram", 4096, num_layers=1))
                before = rss_anon(proc.pid)
                for start in range(0, num_entries, 4096):
                    batch = [i.to_bytes(32, "little") for i in range(start, min(start + 4096, num_entries))]
                    client.commit(client.reserve(ns, batch))
                assert client.stats().dram.num_entries == num_entries
                after = rss_anon(proc.pid)
        finally:
            stop_server(proc)
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)
    return {"entries": num_entries, "bytes_per_million": (after - before) * 1_000_000 / num_entries}


def storage_index(num_entries: int) -> dict:
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-costs-", dir=SHM))
    storage_dir = Path(tempfile.mkdtemp(prefix="hpkv-costs-storage-"))
    store = create_store(configs.pool(pool_dir, 64 * MiB), configs.storage(storage_dir))
    try:
        assert store.storage is not None
        ns = store.register(namespace("costs-storage", 64 << 10, num_layers=1))
        while not store.stats().storage.index_ready:  # type: ignore[union-attr]
            time.sleep(0.01)
        index = store.storage.index
        prefix, value = index.key(ns, b""), index.value_of(64 << 10, time.time())
        keys = [i.to_bytes(32, "little") for i in range(4096)]
        index.add_scanned((prefix + k, value) for k in keys)
        small = median_p99_ms(timed(lambda: store.lookup(ns, keys), 200))
        gc.collect()
        before = psutil.Process().memory_info().rss
        index.add_scanned((prefix + i.to_bytes(32, "little"), value) for i in range(4096, num_entries))
        gc.collect()
        after = psutil.Process().memory_info().rss
        assert len(index) == num_entries
        assert store.lookup(ns, keys).num_hit == 4096
        large = median_p99_ms(timed(lambda: store.lookup(ns, keys), 200))
    finally:
        store.close()
        shutil.rmtree(pool_dir, ignore_errors=True)
        shutil.rmtree(storage_dir, ignore_errors=True)
    return {
        "entries": num_entries,
        "bytes_per_million": (after - before) * 1_000_000 / (num_entries - 4096),
        "lookup_4096_ms": {"median": large[0], "p99": large[1]},
        "lookup_4096_ms_with_4096_indexed": {"median": small[0], "p99": small[1]},
    }


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def _saved(
    pool_dir: Path,
    storage_dir: Path,
    total_bytes: int,
    entry: int,
    payload: np.ndarray,
    storage: bool,
    between: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """One server (`storage`: writing through to its storage directory, else storage off) and a
    client that saves `total_bytes` of `entry`-byte entries after a warm-up, in ROUNDS rounds, in
    each of PHASES; CPU seconds of the server process and of its write-through processes, from
    each round's first save until its last file is written (storage) or its last commit (storage
    off), a list a round, a dict a phase. `between(phase, r)` runs after each round, outside what
    is measured."""
    settings = {"HPKV_KV_MEM_POOL_SIZE": str(POOL_BYTES)}
    if not storage:
        settings["HPKV_KV_STORAGE_ENABLE"] = "0"
    pool_dir.mkdir()
    proc = start_server(server_env(pool_dir, storage_dir, **settings))
    server = psutil.Process(proc.pid)
    phases: list[dict] = []
    try:
        with Client(pool_dir, kind="bench-costs", autostart=False) as client:
            ns = client.register(namespace(f"costs-wt-{entry}", entry, num_layers=1))
            done = 0

            def save(tag: str, n: int) -> None:
                nonlocal done
                for start in range(0, n, 64):
                    # Keys in 4 of the storage tree's leaf directories, which the warm-up makes:
                    # the directories of a tree in use are there (a fresh tree's first write to
                    # each also makes its directory).
                    batch = [
                        bytes([i % 4, 0]) + k[2:] for i, k in enumerate(_keys(min(64, n - start), f"{tag}{start}-"))
                    ]
                    reservation = client.reserve(ns, batch)
                    pool = np.frombuffer(reservation.region.buf, dtype=np.uint8)
                    for offset in reservation.offsets:
                        assert offset is not None
                        np.copyto(pool[offset : offset + entry], payload)
                    client.commit(reservation)
                done += n

            def written() -> int:
                polls, deadline = 0, time.monotonic() + 300
                while storage and (stats := client.stats()).storage.writes < done:  # type: ignore[union-attr]
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{done} entries saved, not all written after 300 s: {stats}")
                    polls += 1
                    time.sleep(0.05)
                return polls

            def save_written(tag: str, n: int) -> int:
                save(tag, n)
                return written()

            save("warm", 16)  # starts the write-through processes, makes the directories
            written()
            while (dram := client.stats().dram).ready_bytes < dram.capacity_bytes:
                time.sleep(0.05)  # the pool's pages, reserved in the background: not this work
            writers = server.children(recursive=True)
            for phase in range(len(PHASES)):
                if phase:  # the pool in use: every page written through WARM_PASSES times more
                    chunk = total_bytes // entry // ROUNDS  # a backlog the pool holds: nothing deferred
                    for start in range(0, WARM_PASSES * POOL_BYTES // entry, chunk):
                        save_written(f"use{phase}-{start}-", chunk)
                phases.append(
                    _rounds(
                        server,
                        writers,
                        save_written,
                        total_bytes // entry,
                        lambda r, phase=phase: between(phase, r) if between else None,
                        f"p{phase}-",
                    )
                )
            idle_before = _cpu_s([server])
            for _ in range(20):  # one second of the same polling, nothing else to do
                client.stats()
                time.sleep(0.05)
            poll_s = (_cpu_s([server]) - idle_before) / 20
    finally:
        stop_server(proc)
    for result in phases:
        result["polls_s"] = poll_s * result.pop("polls")
    return phases


def _rounds(server, writers, save_written, num: int, between: Callable[[int], None], tag: str) -> dict:
    """ROUNDS rounds of `num` // ROUNDS entries saved and written; each one's CPU seconds."""
    main_s: list[float] = []
    writers_s: list[float] = []
    polls = 0
    for r in range(ROUNDS):
        main_before, writers_before = _cpu_s([server]), _cpu_s(writers)
        polls += save_written(f"{tag}{r}-", num // ROUNDS)
        main_s.append(_cpu_s([server]) - main_before)
        writers_s.append(_cpu_s(writers) - writers_before)
        between(r)
    return {"server_s": main_s, "writers_s": writers_s, "polls": polls}


def write_through(
    entry: int, total_bytes: int = GiB, storage_parent: str | None = None, pool_parent: Path = SHM
) -> list[dict]:
    """The write-through's CPU per GiB and its parts, a dict for each of PHASES, against the
    floor measured in the same rounds (the spread of the rounds' ratios is the machine's noise)."""
    pool_dir = Path(tempfile.mkdtemp(prefix="hpkv-costs-", dir=pool_parent))
    storage_dir = Path(tempfile.mkdtemp(prefix="hpkv-costs-wt-", dir=storage_parent))
    payload = np.random.default_rng(0).integers(0, 255, entry, dtype=np.uint8)
    num = total_bytes // entry
    per_round = num // ROUNDS
    source = np.empty((num, entry), dtype=np.uint8)
    source[:] = payload  # what the client copies into the slots, at as many addresses
    source = source.reshape(-1)
    floors: list[list[float]] = [[] for _ in PHASES]
    (storage_dir / "floor").mkdir()

    def floor_round(phase: int, r: int) -> None:
        os.sync()  # neither side pays for the other's dirty pages
        entries = range(r * per_round, (r + 1) * per_round)
        floors[phase].append(_floor(storage_dir / "floor", source, entry, entries, f"{phase}-"))
        os.sync()

    try:
        puts = _saved(pool_dir / "puts", storage_dir / "unused", total_bytes, entry, payload, storage=False)
        os.sync()
        writes = _saved(pool_dir / "writes", storage_dir / "tree", total_bytes, entry, payload, True, floor_round)
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)
        shutil.rmtree(storage_dir, ignore_errors=True)
    pool = "huge pages" if pool_parent != SHM else f"{SHM} ({_shm_pages()})"
    return [
        _ratios(entry, total_bytes, pool, name, w, puts[min(i, len(puts) - 1)], f)
        for i, (name, w, f) in enumerate(zip(PHASES, writes, floors, strict=True))
    ]


def _ratios(entry: int, total_bytes: int, pool: str, phase: str, writes: dict, puts: dict, floors: list[float]) -> dict:
    gib = total_bytes / GiB
    floor = sum(floors) / gib
    server_s, writers_s = sum(writes["server_s"]) / gib, sum(writes["writers_s"]) / gib
    total = server_s + writers_s
    own = total - (sum(puts["server_s"]) + writes["polls_s"]) / gib
    rounds = [(m + w) / f for m, w, f in zip(writes["server_s"], writes["writers_s"], floors, strict=True)]
    return {
        "entry_bytes": entry,
        "pool": pool,
        "phase": phase,
        "cpu_s_per_gib": total,
        "server_s_per_gib": server_s,
        "writers_s_per_gib": writers_s,
        "puts_s_per_gib": sum(puts["server_s"]) / gib,
        "polls_s_per_gib": writes["polls_s"] / gib,
        "write_through_s_per_gib": own,
        "floor_cpu_s_per_gib": floor,
        "round_ratios": rounds,
        "ratio": total / floor,
        "write_through_ratio": own / floor,
    }


def _shm_pages() -> str:
    """The page size of a pool on /dev/shm: 4 KiB unless shmem's transparent huge pages are on."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return "4 KiB pages"
    return "huge pages" if "[always]" in mode or "[within_size]" in mode or "[force]" in mode else "4 KiB pages"


def _floor(directory: Path, source: np.ndarray, entry: int, entries: range, tag: str = "") -> float:
    """CPU seconds of the checksum and a copy into the page cache of `source`'s `entries`, `entry`
    bytes a file: distinct bytes in memory, as the pool's slots are, not one buffer in the CPU's
    cache."""
    start = time.thread_time()  # this thread's: not what other threads of the process do
    for i in entries:
        part = source[i * entry : (i + 1) * entry]
        xxhash.xxh3_64_intdigest(part)
        fd = os.open(directory / f"{tag}{i}.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, part)
        finally:
            os.close(fd)
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-entries", type=int, default=10_000_000)
    parser.add_argument("--entry-mib", type=float, nargs="+", default=[1.0, 4.0], help="write-through entry sizes")
    parser.add_argument(
        "--storage-dir", help="where the write-through's storage goes (default: the temporary directory)"
    )
    parser.add_argument("--write-through-only", action="store_true", help="skip the two index measurements")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    dram = storage = None
    if not args.write_through_only:
        log("costs: DRAM index")
        dram = dram_index()
        log("costs: storage index")
        storage = storage_index(args.storage_entries)
    writes = []
    with huge_tmpfs(5 * GiB) as huge:  # a pool on 2 MiB pages beside /dev/shm's, where one can be had
        for pool_parent in (SHM, huge) if huge is not None else (SHM,):
            for entry in args.entry_mib:
                log(f"costs: write-through, {entry} MiB entries, pool in {pool_parent}")
                writes += write_through(int(entry * MiB), storage_parent=args.storage_dir, pool_parent=pool_parent)
    result = {"dram_index": dram, "storage_index": storage, "write_through": writes, "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)


def print_report(result: dict) -> None:
    dram, storage, writes = result["dram_index"], result["storage_index"], result["write_through"]
    print(f"HPKV index and write-through costs ({result['cpus']} CPUs, load {os.getloadavg()[0]:.2f})")
    if dram is not None:
        print(f"  DRAM index: {dram['bytes_per_million'] / MiB:.0f} MiB of server memory per million entries")
        big, small = storage["lookup_4096_ms"], storage["lookup_4096_ms_with_4096_indexed"]
        print(
            f"  storage index: {storage['bytes_per_million'] / MiB:.0f} MiB per million entries; a 4,096-key lookup"
            f" with {storage['entries']:,} indexed: median {big['median']:.2f} ms, p99 {big['p99']:.2f} ms"
            f" (with 4,096 indexed: {small['median']:.2f} ms = {big['median'] / small['median']:.2f}x)"
        )
    for w in writes:
        print(
            f"  write-through, {w['entry_bytes'] / MiB:g} MiB entries, pool on {w['pool']}, {w['phase']}:"
            f" {w['cpu_s_per_gib']:.2f} CPU s/GiB (server"
            f" process {w['server_s_per_gib']:.2f}, write-through processes {w['writers_s_per_gib']:.2f}) vs floor"
            f" {w['floor_cpu_s_per_gib']:.2f} = {w['ratio']:.2f}x (target <= {TARGET_WRITE_RATIO}x:"
            f" {verdict(w['ratio'] <= TARGET_WRITE_RATIO)}; rounds {min(w['round_ratios']):.2f}"
            f"-{max(w['round_ratios']):.2f}x)"
        )
        print(
            f"    of which not write-through work: the server handling the puts {w['puts_s_per_gib']:.2f}"
            f" (storage off, same saves), the stats polls {w['polls_s_per_gib']:.3f}; without them"
            f" {w['write_through_s_per_gib']:.2f} = {w['write_through_ratio']:.2f}x"
            f" ({verdict(w['write_through_ratio'] <= TARGET_WRITE_RATIO)})"
        )


if __name__ == "__main__":
    main()
