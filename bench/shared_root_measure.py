"""The shared storage root measured: N node processes on one directory of GlusterFS (or MooseFS)
holding M files, today's design (`HPKV_KV_STORAGE_CLUSTER=off`, one node: each node does the same)
beside the cluster (every node), for the figures `bench.shared_root_sim` models.

    python -m bench.shared_root_measure [--files 500000] [--nodes 4] [--fs glusterfs] [--passes 2]

As root (it sets the file system up, `bench.harness.netfs`). The M files (4 KiB each, one
namespace, keys spread over the 65,536 leaf directories) are written first by 4 processes through
the two mounts. Then, today: one tier's start-up walk and one walk again (`rescan`), its index's
entries and memory. The cluster: N tiers (processes, alternating between the two mounts), each
its start-up (join and first pass over its parts), its index's entries and memory, then, once
every part is evictable, `--passes` passes each with the metadata operations they made through
the storage I/O seam (listings, `stat`s by name: the node's own thread may pass too meanwhile,
so a pass's own figures are its `PassResult` and its length as the cluster recorded it, after
any wait for the other pass), and what the membership saw (members expired, renewals failed);
and how long a lookup on node 1 takes to find a file node 0 just wrote. Prints one JSON object;
slow (minutes at 500,000 files on GlusterFS).
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.harness.netfs import netfs_beds
from hpkv.config import StorageConfig
from hpkv.storage.fileio import FileIO

NS = "ab" * 16
FILE_BYTES = 4096
BIG = 1 << 50


class Counted(FileIO):
    def __init__(self) -> None:
        self.listings = self.stats = 0

    def list_dir(self, dir_fd):
        self.listings += 1
        return super().list_dir(dir_fd)

    def stat_path(self, path, dir_fd=None):
        self.stats += 1
        return super().stat_path(path, dir_fd=dir_fd)


def key_of(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def _populate(args: tuple[str, int, int]) -> int:
    root, start, stop = args
    made: set[str] = set()
    data = b"\0" * FILE_BYTES
    for i in range(start, stop):
        h = key_of(i).hex()
        d = f"{root}/{NS}/{h[:2]}/{h[2:4]}"
        if d not in made:
            os.makedirs(d, exist_ok=True)
            made.add(d)
        fd = os.open(f"{d}/{h}.kv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, data)
        os.close(fd)
    return stop - start


def populate(roots: list[Path], files: int, workers: int = 4) -> float:
    started = time.monotonic()
    step = 5000
    jobs = [(str(roots[(i // step) % len(roots)]), i, min(files, i + step)) for i in range(0, files, step)]
    with mp.get_context("fork").Pool(workers) as pool:
        for _ in pool.imap_unordered(_populate, jobs):
            pass
    return time.monotonic() - started


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def config(root: Path, cluster: str) -> StorageConfig:
    base = StorageConfig(path=root, enabled=True, capacity_bytes=BIG, fsync="off", io_threads=2)
    return replace(base, cluster=cluster)


def today(root: Path, out) -> None:
    from hpkv.storage.storage_tier import StorageTier

    before = rss_bytes()
    tier = StorageTier(config(root, "off"))
    started = time.monotonic()
    tier.start()
    tier.scan_done.wait()
    scan_s = time.monotonic() - started
    memory = rss_bytes() - before
    started = time.monotonic()
    tier.rescan.once()
    out.send(
        {
            "startup_walk_s": scan_s,
            "walk_s": time.monotonic() - started,
            "indexed": len(tier.index),
            "index_rss_mib": memory / 2**20,
        }
    )
    tier.close()


def say(what: str, value) -> None:
    """A partial result on stderr as it comes (a run of many minutes may be cut short)."""
    print(f"{time.strftime('%H:%M:%S')} {what}: {json.dumps(value)}", file=sys.stderr, flush=True)


def node(root: Path, nodes: int, passes: int, conn) -> None:
    from hpkv.storage.storage_tier import StorageTier

    faulthandler.enable()

    io = Counted()
    before = rss_bytes()
    tier = StorageTier(config(root, "on"), io=io)
    started = time.monotonic()
    tier.start()
    tier.scan_done.wait()
    report = {
        "startup_s": time.monotonic() - started,
        "startup_listings": io.listings,
        "startup_stats": io.stats,
        "indexed": len(tier.index),
        "index_rss_mib": (rss_bytes() - before) / 2**20,
    }
    cluster = tier.cluster
    assert cluster is not None
    ledger = cluster.ledger
    while len(cluster.members.live()) < nodes or not ledger.owned.any() or (ledger.evictable != ledger.owned).any():
        time.sleep(1)
    say(f"node {os.getpid()} started", report)
    conn.send("settled")
    conn.recv()  # every node settled
    report["parts"] = int(cluster.ledger.owned.sum())
    report["passes"] = []
    for _ in range(passes):
        io.listings = io.stats = 0
        started = time.monotonic()
        result = cluster.pass_once()
        assert cluster.last_pass is not None
        report["passes"].append(
            {
                "s": cluster.last_pass[1],
                "call_s": time.monotonic() - started,
                "dirs_statted": result.dirs_statted,
                "dirs_listed": result.dirs_listed,
                "files_statted": result.files_statted,
                "listings_during_call": io.listings,
                "stats_during_call": io.stats,
            }
        )
    report["indexed_after"] = len(tier.index)
    seen = tier.stats().cluster
    assert seen is not None
    report["membership"] = {
        k: getattr(seen, k)
        for k in ("members_expired", "members_back", "renew_failures", "list_failures", "lease_remade", "passes")
    }
    say(f"node {os.getpid()}", report)
    conn.send(report)
    while True:
        op = conn.recv()
        if op == "stop":
            break
        kind, k = op
        if kind == "write":
            conn.send(tier.write_from(NS, k, memoryview(b"\1" * FILE_BYTES)))
        else:
            started = time.monotonic()
            while not tier.contains(NS, k):
                time.sleep(0.01)
            conn.send(time.monotonic() - started)
    tier.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=500_000)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--fs", default="glusterfs")
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    ctx = mp.get_context("fork")
    began = time.monotonic()
    with netfs_beds((args.fs,)) as beds:
        shared = beds[args.fs]
        if isinstance(shared, str):
            raise SystemExit(shared)
        roots = [shared.mount_a / "measure", shared.mount_b / "measure"]
        roots[0].mkdir()
        result: dict = {"fs": args.fs, "files": args.files, "nodes": args.nodes}
        result["populate_s"] = populate(roots, args.files)
        say("populated", result)
        here, there = ctx.Pipe()
        p = ctx.Process(target=today, args=(roots[1], there))
        p.start()
        there.close()  # a child that dies is an EOFError here, not a wait for ever
        result["today"] = here.recv()
        say("today", result["today"])
        p.join()
        conns, procs = [], []
        for i in range(args.nodes):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=node, args=(roots[i % 2], args.nodes, args.passes, there))
            proc.start()
            there.close()
            conns.append(here)
            procs.append(proc)
        for c in conns:
            assert c.recv() == "settled"
        for c in conns:
            c.send("go")
        result["cluster"] = [c.recv() for c in conns]
        k = key_of(args.files + 1)
        conns[0].send(("write", k))
        assert conns[0].recv()
        conns[1].send(("find", k))
        result["lookup_finds_other_nodes_write_s"] = conns[1].recv()
        for c in conns:
            c.send("stop")
        for proc in procs:
            proc.join()
    result["took_s"] = time.monotonic() - began
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
