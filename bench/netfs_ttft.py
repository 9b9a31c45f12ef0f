"""Node B's time to first token on a storage hit of what node A computed, over each network file
system, against a local storage directory.

    python -m bench.netfs_ttft [--repeats 3] [--prompt-words 2048] [--model PATH]

Two nodes, each a real vLLM (the prefill-heavy random `BENCH` model, built locally) with its
own pool and its own `hpkv server` (own host name). The engines start once; per storage (a local
directory, then GlusterFS and MooseFS each mounted twice: `bench.harness.netfs`, as root) only
the servers are replaced, by servers on that storage, A's on one mount, B's on the other. An
engine's first calls to a new server fail (its connection was to the old one: a miss, a save
dropped) and it reconnects, so each engine first sends short prompts (the engines' token
threshold is lowered for that; the timed prompts are far over either). Per repeat, a new
prompt: A computes it, its files land on B's mount, and B, which never saw it, sends it (timed,
after an untimed tiny request: `Engine.measure`), after one such round untimed; the row is the
median, with the median of B's cold TTFT on prompts nobody saw (one per repeat) as the recompute
it saves. A timed request that does not come from storage (nine tenths of its prompt at least)
is reported, not used. Progress to stderr, the table to stdout.
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
from collections.abc import Callable
from pathlib import Path

from bench.harness.engine import Engine, engine_env, start_together
from bench.harness.netfs import NodeServer, Shared, netfs_beds
from bench.harness.report import log
from hpkv.demo.model import BENCH, build_model, prompt_text

THRESHOLD = 64  # tokens: the reconnecting prompts are looked up and saved


def _num_files(root: Path) -> int:
    """KV files under `root`; -1 while a temporary is in flight."""
    names = [p.name for p in root.rglob("*")]
    return -1 if any(n.endswith(".tmp") for n in names) else sum(n.endswith(".kv") for n in names)


def _settled(root: Path, more_than: int, timeout_s: float = 120.0) -> None:
    """Until B's mount shows more than `more_than` files and no temporary, the same on three polls."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen.append(_num_files(root))
        if len(seen) >= 3 and seen[-1] > more_than and seen[-3] == seen[-2] == seen[-1]:
            return
        time.sleep(0.3)


def files_arrive(root: Path) -> Callable[[], Callable[[], None]]:
    """For `measure`: armed before A's request, waits after it until its files are on `root`."""

    def arm() -> Callable[[], None]:
        before = _num_files(root)
        return lambda: _settled(root, before)

    return arm


def hpkv_env(pool: Path, root: Path, work: Path) -> dict[str, str]:
    return {
        **engine_env(),
        "VLLM_ENABLE_HPKV": "1",
        "VLLM_HPKV_TOKEN_THRESHOLD": str(THRESHOLD),
        "HPKV_KV_MEM_POOL_SIZE": "512m",
        "HPKV_SHARE_MEM_FILE_PATH": str(pool),
        "HPKV_KV_STORAGE_PATH": str(root),
        "HPKV_CONFIG_FILE_PATH": str(work / "no-config.ini"),
    }


class Servers:
    """Node A's and node B's HPKV servers; `use(a_root, b_root)` replaces them with servers on those."""

    def __init__(self, pools: list[Path], work: Path) -> None:
        self.pools, self.work = pools, work
        self.running: list[NodeServer] = []

    def use(self, a_root: Path, b_root: Path, settings: dict[str, str] | None = None) -> None:
        """`settings`: more HPKV_* variables of both servers (the cluster tier's, say)."""
        self.stop()
        outside = {k: v for k, v in os.environ.items() if not k.startswith(("HPKV_", "VLLM_HPKV_", "VLLM_ENABLE"))}
        for name, pool, root in zip("ab", self.pools, (a_root, b_root)):
            # PATH, and PYTHONPATH: these sources
            env = {**outside, **hpkv_env(pool, root, self.work), **(settings or {})}
            self.running.append(NodeServer(f"node{name}", env, self.work / f"server-{name}-{time.time_ns()}.log"))

    def stop(self) -> None:
        while self.running:
            self.running.pop().stop()


def reconnect(engines: list[Engine], words: int = 200) -> None:
    """Each engine's calls to its node's new server, until one of its prompts is saved there."""
    for engine in engines:
        for i in range(3):  # the first fails (the old server's connection); the next reconnects
            engine.complete(prompt_text(words, seed=zlib.crc32(f"{engine.name} {time.time_ns()} {i}".encode())), 1)


def measure(
    name: str,
    a: Engine,
    b: Engine,
    repeats: int,
    words: int,
    arrived: Callable[[], Callable[[], None]],
    source: str = "disk",
) -> dict:
    """B's hit TTFT on prompts A computed and B's cold TTFT on prompts nobody saw, each the
    median of `repeats` (one of each per repeat: the machine's phase moves both). `arrived()`
    is called before A's request and what it returns after it: it waits until A's KV is where B
    reads it. A hit counts only when nine tenths of its prompt came from `source` (vLLM's cache
    source: "disk" for storage, "host" for the DRAM pool, where cluster hits are served from)."""
    hits, colds = [], []
    for r in range(-1, repeats):  # -1: untimed, the first hit through these servers
        text = prompt_text(words, seed=zlib.crc32(f"{name} {r}".encode()) % 100_000)
        wait = arrived()
        a.complete(text, 1)
        wait()
        sample = b.measure(text, 1)[1]
        if sample.sources.get(source, 0) < 0.9 * sample.prompt_tokens or sample.sources.get("device", 0) > 0:
            log(f"{name}: repeat {r} was not a hit from {source} ({sample.sources})")
        elif r >= 0:
            hits.append(sample.ttft_s)
            log(f"{name}: repeat {r}: hit {1000 * sample.ttft_s:.0f} ms")
        if r >= 0:
            cold = b.measure(prompt_text(words, seed=zlib.crc32(f"{name} cold {r}".encode())), 1)[1]
            if any(cold.sources.values()):
                log(f"{name}: repeat {r}'s cold prompt hit a cache ({cold.sources})")
            else:
                colds.append(cold.ttft_s)
    row = {
        "storage": name,
        "hit_ms": 1000 * statistics.median(hits) if hits else float("nan"),
        "hits_ms": [round(1000 * t) for t in hits],
        "cold_ms": 1000 * statistics.median(colds) if colds else float("nan"),
        "colds_ms": [round(1000 * t) for t in colds],
    }
    log(f"{name}: hit {row['hit_ms']:.0f} ms, cold {row['cold_ms']:.0f} ms ({len(hits)} hits)")
    return row


def run(model: str, work: Path, repeats: int, words: int) -> list[dict]:
    rows = []
    with contextlib.ExitStack() as stack:
        local = Path(tempfile.mkdtemp(prefix="hpkv-bench-kv-", dir="/var/tmp"))
        pools = [Path(tempfile.mkdtemp(prefix=f"hpkv-node{n}-", dir="/dev/shm")) for n in "ab"]
        for path in (local, *pools):
            stack.callback(shutil.rmtree, path, True)
        storages = [("local directory", local, local)]
        for name, bed in stack.enter_context(netfs_beds()).items():
            if isinstance(bed, Shared):
                kv = f"kv-{time.time_ns()}"
                (bed.mount_a / kv).mkdir()
                storages.append((name, bed.mount_a / kv, bed.mount_b / kv))
            else:
                log(f"{name}: skipped, {bed}")
        servers = Servers(pools, work)
        stack.callback(servers.stop)
        servers.use(local, local)
        engines = [Engine(n, model, hpkv_env(pool, local, work), True, work) for n, pool in zip("ab", pools)]
        for engine in engines:
            stack.callback(engine.stop)
        start_together(engines)
        b = engines[1]
        b.measure(prompt_text(words, seed=-1), 1)  # untimed: B's first request pays one-time costs
        for name, a_root, b_root in storages:
            if a_root != local:
                servers.use(a_root, b_root)
                reconnect(engines)
            rows.append(measure(name, engines[0], b, repeats, words, files_arrive(b_root)))
    return rows


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
    rows = run(model, work, args.repeats, args.prompt_words)
    base = rows[0]["hit_ms"]
    print(f"{'storage':<18} {'B storage hit ms':>17} {'vs local':>9} {'B cold ms':>10}")
    for row in rows:
        print(f"{row['storage']:<18} {row['hit_ms']:>17.0f} {row['hit_ms'] / base:>8.2f}x {row['cold_ms']:>10.0f}")
    print(f"engine logs: {work}")


if __name__ == "__main__":
    main()
