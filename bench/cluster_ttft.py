"""Node B's time to first token on a prompt node A computed, in one run: through the cluster tier,
through a shared GlusterFS directory, from B's own storage, and B recomputing it.

    python -m bench.cluster_ttft [--repeats 3] [--prompt-words 2048] [--model PATH] [--json]

Two nodes, each a real vLLM (the prefill-heavy random `BENCH` model) with its own pool and its own
`hpkv server` (own host name), as `bench.netfs_ttft` runs them: the engines start once, and per
row only the servers are replaced (`netfs_ttft.Servers`; the engines reconnect with short
prompts). The rows, in this order:
- `own storage`: both servers on one local directory (ext4 under /var/tmp): B reads A's files as
  it reads its own (a storage hit, vLLM's `disk` source);
- `cluster tier`: each server on a local directory of its own (no file is shared) and the cluster
  tier on, on a real `mooncake_master` with a segment process per node on 127.0.0.1
  (`bench.harness.mooncake`): B's server finds A's objects in the cluster, reads them into its
  pool, and serves them as DRAM hits (vLLM's `host` source); a hit waits until A's server has
  written the prompt's objects;
- `glusterfs`: A's server on one mount of a one-brick GlusterFS volume, B's on the other
  (`bench.harness.netfs`, as root; the bed is one per machine: the run first waits for another's);
- `recompute`: B's cold TTFT on prompts nobody saw (one per repeat of each row; their median).
Per repeat a new prompt: A computes it, then B, which never saw it, sends it (timed, right after
an untimed tiny request: `Engine.measure`); one such round untimed first; each row is the median.
A timed request not served from its row's source (nine tenths of its prompt) is reported, not used.
Progress to stderr, the table (or `--json`) to stdout. Run it under `flock /tmp/hpkv-engine.lock`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness.engine import Engine, start_together
from bench.harness.mooncake import start_master, stop_master
from bench.harness.netfs import Shared, netfs_beds
from bench.harness.report import log
from bench.netfs_ttft import Servers, files_arrive, hpkv_env, measure, reconnect
from hpkv.cluster import segment
from hpkv.demo.model import BENCH, build_model, prompt_text
from hpkv.server.client import Client


def cluster_settings(master: str) -> dict[str, str]:
    """The cluster tier on both servers: each node contributes a segment (its own process)."""
    return {
        "HPKV_CLUSTER_ENABLE": "1",
        "HPKV_CLUSTER_MASTER": master,
        "HPKV_CLUSTER_HOST": "127.0.0.1",
        "HPKV_CLUSTER_SEGMENT_SIZE": "1g",
        "HPKV_CLUSTER_BUFFER_SIZE": "16m",
    }


def _objects_written(pool: Path) -> int:
    with Client(pool, kind="bench", autostart=False) as client:
        cluster = client.stats().cluster
    return cluster.objects_written if cluster is not None else 0


def cluster_arrives(pool_a: Path, timeout_s: float = 120.0) -> Callable[[], Callable[[], None]]:
    """For `measure`: waits after A's request until A's server has written more objects to the
    cluster than before it, the same count on three polls (its write-through is done)."""

    def arm() -> Callable[[], None]:
        before = _objects_written(pool_a)

        def wait() -> None:
            seen: list[int] = []
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                seen.append(_objects_written(pool_a))
                if len(seen) >= 3 and seen[-1] > before and seen[-3] == seen[-2] == seen[-1]:
                    return
                time.sleep(0.3)
            log(f"A's server wrote {seen[-1:]} objects to the cluster after {timeout_s:.0f} s (before: {before})")

        return wait

    return arm


def run(model: str, work: Path, repeats: int, words: int) -> list[dict]:
    rows = []
    with contextlib.ExitStack() as stack:
        # First, so that it goes last (the servers hold files on its mounts); a machine's one
        # GlusterFS bed may be another's for a while: waited for here, before any engine starts.
        bed = stack.enter_context(netfs_beds(("glusterfs",)))["glusterfs"]
        own, root_a, root_b = (Path(tempfile.mkdtemp(prefix=f"hpkv-bench-{n}-", dir="/var/tmp")) for n in "oab")
        pools = [Path(tempfile.mkdtemp(prefix=f"hpkv-node{n}-", dir="/dev/shm")) for n in "ab"]
        for path in (own, root_a, root_b, *pools):
            stack.callback(shutil.rmtree, path, True)
        master, address = start_master(work)
        stack.callback(stop_master, master)
        for pool in pools:  # the segment processes outlive the servers; after them, before the master
            stack.callback(segment.stop, pool)
        servers = Servers(pools, work)
        stack.callback(servers.stop)
        servers.use(own, own)
        engines = [Engine(n, model, hpkv_env(pool, own, work), True, work) for n, pool in zip("ab", pools)]
        for engine in engines:
            stack.callback(engine.stop)
        start_together(engines)
        a, b = engines
        b.measure(prompt_text(words, seed=-1), 1)  # untimed: B's first request pays one-time costs
        rows.append(measure("own storage", a, b, repeats, words, files_arrive(own)))
        servers.use(root_a, root_b, cluster_settings(address))
        reconnect(engines)
        rows.append(measure("cluster tier", a, b, repeats, words, cluster_arrives(pools[0]), source="host"))
        if isinstance(bed, Shared):
            kv = f"kv-{time.time_ns()}"
            (bed.mount_a / kv).mkdir()
            servers.use(bed.mount_a / kv, bed.mount_b / kv)
            reconnect(engines)
            rows.append(measure("glusterfs", a, b, repeats, words, files_arrive(bed.mount_b / kv)))
        else:
            log(f"glusterfs: skipped, {bed}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-words", type=int, default=2048)
    parser.add_argument("--model")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C: every engine, server, segment, master and mount is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    work = Path(tempfile.mkdtemp(prefix="hpkv-bench-cluster-ttft-"))
    # Where bench.vllm_ttft keeps it: vLLM's compile cache is by model path.
    model = args.model or str(build_model(Path(tempfile.gettempdir()) / "hpkv-vllm-bench" / "bench-model", BENCH))
    started = time.monotonic()
    rows = run(model, work, args.repeats, args.prompt_words)
    recompute = statistics.median(t for row in rows for t in row["colds_ms"])
    out = {
        "rows": rows,
        "recompute_ms": recompute,
        "prompt_words": args.prompt_words,
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
        "seconds": round(time.monotonic() - started),
        "logs": str(work),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{'node B':<14} {'TTFT ms':>8} {'vs own storage':>15} {'vs recompute':>13}  each hit (ms)")
    base = rows[0]["hit_ms"]
    for row in rows:
        hit = row["hit_ms"]
        print(f"{row['storage']:<14} {hit:>8.0f} {hit / base:>14.2f}x {hit / recompute:>12.3f}x  {row['hits_ms']}")
    colds = [t for row in rows for t in row["colds_ms"]]
    print(f"{'recompute':<14} {recompute:>8.0f} {recompute / base:>14.2f}x {1:>12.3f}x  {colds}")
    print(f"load average {out['load_average'][0]:.1f}; {out['seconds']} s; engine logs: {work}")


if __name__ == "__main__":
    main()
