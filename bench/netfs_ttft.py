"""Node B's time to first token on a storage hit of what node A computed, over each network file
system, against a local storage directory.

    python -m bench.netfs_ttft [--repeats 3] [--prompt-words 2048] [--model PATH]

For each storage (a local directory, then GlusterFS and MooseFS each mounted twice:
`bench.harness.netfs`, as root), two nodes: each an `hpkv server` with its own host name and
pool, and a real vLLM (the prefill-heavy random `BENCH` model, built locally). Per repeat, a new
prompt: A computes it, its files land on B's mount, and B, which never saw it, sends it (timed,
after an untimed tiny request: `Engine.measure`), after one such round untimed; the row is the
median, with B's cold TTFT on a prompt nobody saw as the recompute it saves. A timed request that
does not come from storage is reported, not used. Progress to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

from bench.harness.engine import Engine, engine_env, start_together
from bench.harness.netfs import NodeServer, Shared, netfs_beds
from bench.harness.report import log
from hpkv.demo.model import BENCH, build_model, prompt_text


def _settled(root: Path, timeout_s: float = 120.0) -> None:
    """Until B's mount shows A's files and no temporary, the same on three polls."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = [p.name for p in root.rglob("*")]
        seen.append(sum(n.endswith(".kv") for n in names) if not any(n.endswith(".tmp") for n in names) else -1)
        if len(seen) >= 3 and seen[-1] > 0 and seen[-3] == seen[-2] == seen[-1]:
            return
        time.sleep(0.3)


def _without_hpkv() -> dict[str, str]:
    """This process's environment (PATH, PYTHONPATH: the server runs these sources) less HPKV's."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("HPKV_", "VLLM_HPKV_", "VLLM_ENABLE_HPKV"))}


@contextlib.contextmanager
def two_nodes(model: str, a_root: Path, b_root: Path, work: Path, tag: str):
    servers, engines, pools = [], [], []
    try:
        for name, root in (("a", a_root), ("b", b_root)):
            pools.append(Path(tempfile.mkdtemp(prefix=f"hpkv-node{name}-", dir="/dev/shm")))
            env = {
                **engine_env(),
                "VLLM_ENABLE_HPKV": "1",
                "HPKV_KV_MEM_POOL_SIZE": "512m",
                "HPKV_SHARE_MEM_FILE_PATH": str(pools[-1]),
                "HPKV_KV_STORAGE_PATH": str(root),
                "HPKV_CONFIG_FILE_PATH": str(work / "no-config.ini"),
            }
            servers.append(
                NodeServer(f"node{name}", {**_without_hpkv(), **env}, work / f"server-{name}-{time.time_ns()}.log")
            )
            engines.append(Engine(f"{tag}-{name}", model, env, True, work))
        start_together(engines)
        yield engines[0], engines[1]
    finally:
        for engine in engines:
            engine.stop()
        for server in servers:
            server.stop()
        for pool in pools:
            shutil.rmtree(pool, ignore_errors=True)


def measure(name: str, model: str, a_root: Path, b_root: Path, work: Path, repeats: int, words: int) -> dict:
    a_root.mkdir(exist_ok=True)
    with two_nodes(model, a_root, b_root, work, name.split()[0]) as (a, b):
        b.measure(prompt_text(words, seed=-1), 1)  # untimed: B's first request pays one-time costs
        cold = b.measure(prompt_text(words, seed=-2), 1)[1].ttft_s
        hits = []
        for r in range(-1, repeats):  # -1: untimed, B's first storage hit pays one-time costs
            text = prompt_text(words, seed=zlib.crc32(f"{name} {r}".encode()) % 100_000)
            a.complete(text, 1)
            _settled(b_root)
            sample = b.measure(text, 1)[1]
            if not (sample.sources.get("disk", 0) > 0 and sample.sources.get("device", 0) == 0):
                log(f"{name}: repeat {r} was not a storage hit ({sample.sources})")
            elif r >= 0:
                hits.append(sample.ttft_s)
                log(f"{name}: repeat {r}: storage hit {1000 * sample.ttft_s:.0f} ms")
    row = {"storage": name, "hit_ms": 1000 * statistics.median(hits) if hits else float("nan"), "cold_ms": 1000 * cold}
    log(f"{name}: storage hit {row['hit_ms']:.0f} ms, cold {row['cold_ms']:.0f} ms ({len(hits)} hits)")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-words", type=int, default=2048)
    parser.add_argument("--model")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C: every engine, server and mount is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    work = Path(tempfile.mkdtemp(prefix="hpkv-bench-netfs-ttft-"))
    # Where bench.vllm_ttft keeps it: vLLM's compile cache is by model path.
    model = args.model or str(build_model(Path(tempfile.gettempdir()) / "hpkv-vllm-bench" / "bench-model", BENCH))
    rows = []
    local = Path(tempfile.mkdtemp(prefix="hpkv-bench-kv-", dir="/var/tmp"))
    try:
        rows.append(measure("local directory", model, local, local, work, args.repeats, args.prompt_words))
        with netfs_beds() as beds:
            for name, bed in beds.items():
                if isinstance(bed, Shared):
                    kv = f"kv-{time.time_ns()}"
                    rows.append(
                        measure(name, model, bed.mount_a / kv, bed.mount_b / kv, work, args.repeats, args.prompt_words)
                    )
                else:
                    log(f"{name}: skipped, {bed}")
    finally:
        shutil.rmtree(local, ignore_errors=True)
    base = rows[0]["hit_ms"]
    print(f"{'storage':<18} {'B storage hit ms':>17} {'vs local':>9} {'B cold ms':>10}")
    for row in rows:
        print(f"{row['storage']:<18} {row['hit_ms']:>17.0f} {row['hit_ms'] / base:>8.2f}x {row['cold_ms']:>10.0f}")
    print(f"engine logs: {work}")


if __name__ == "__main__":
    main()
