"""What KV events (issue 35) cost the lookups and saves of an engine: events on against off, one run.

Starts a real server with a storage tier, then, from this (client) process, in alternating rounds
(so background load hits both alike):
- off: no client watches the journal (vLLM's default, no --kv-events-config): the tiers' hooks
  are unset;
- on: the namespace is watched and a reader polls its journal every 0.1 s from its own connection,
  as an engine's poller does (`integrations/vllm/eventfeed.py`);
and times, in each, the round trip of a 4,096-key prefix lookup (all DRAM hits) and a reserve +
commit of 64 new entries (each journaled in DRAM, then again once written through to storage).
Then the engine-side cost: `TierEvents` describing a request's saved blocks and publishing them
(per block, on vLLM's own `Request`), against the scheduler's step it runs in.
Target: lookups and saves with events on within 10% (or 0.05 ms) of off.

    .venv/bin/python -m bench.kv_events [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

from bench.harness.keys import keys as _keys
from bench.harness.keys import namespace
from bench.harness.report import median_p99_ms, timed, verdict
from bench.harness.server import temporary_server
from hpkv.server.client import Client

ROUNDS = 10
REPS = 50  # per round and mode
ENTRY = 16 << 10  # a small model's block: the journal's cost per entry shows most


class Watcher:
    """A connection that watches `ns` and reads its journal every 0.1 s, as an engine's poller."""

    def __init__(self, pool_dir, desc, ns: str) -> None:
        self.client = Client(pool_dir, kind="bench-events", autostart=False)
        self.client.register(desc)
        (page,) = self.client.journal([(ns, -1)]).pages
        self.cursor, self.ns, self.records = page.last, ns, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self._read()

    def _read(self) -> None:
        more = True
        while more:
            (page,) = self.client.journal([(self.ns, self.cursor)]).pages
            self.cursor, self.records, more = page.last, self.records + len(page.keys), page.more

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        self._read()  # the rest, for the count
        self.client.close()
        time.sleep(0.2)  # the server drops the watch with the connection
        return self.records


def run() -> dict:
    with temporary_server("hpkv-bench-events-") as (pool_dir, _):
        client = Client(pool_dir, kind="bench", autostart=False)
        desc = namespace("events", ENTRY, dtype="bfloat16", num_layers=2)
        ns = client.register(desc)
        prefix = _keys(4096, "lookup")
        client.commit(client.reserve(ns, prefix))
        counter = iter(range(10**9))

        def save() -> None:
            client.commit(client.reserve(ns, _keys(64, f"save{next(counter)}-")))

        times: dict[str, dict[str, list[float]]] = {m: {"lookup": [], "save": []} for m in ("off", "on")}
        records = 0
        for _ in range(ROUNDS):
            for mode in ("off", "on"):
                watcher = Watcher(pool_dir, desc, ns) if mode == "on" else None
                times[mode]["lookup"] += timed(lambda: client.lookup(ns, prefix), REPS)
                times[mode]["save"] += timed(save, REPS)
                if watcher is not None:
                    records += watcher.close()
        client.close()
    result: dict = {
        "journal_records_read": records,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    for op in ("lookup", "save"):
        off, on = (median_p99_ms(times[m][op]) for m in ("off", "on"))
        result[op] = {"off_ms": off[0], "on_ms": on[0], "off_p99_ms": off[1], "on_p99_ms": on[1]}
        result[op]["within_target"] = on[0] <= max(off[0] * 1.1, off[0] + 0.05)
    result["engine_side_us_per_block"] = _engine_side()
    return result


def _engine_side() -> float | None:
    """Microseconds `TierEvents` spends per saved block: described, then announced (vLLM needed)."""
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        from hpkv.integrations.vllm.events import STORED, TierEvents
        from hpkv.integrations.vllm.layout import BlockLayout, block_keys
    except ImportError:
        return None
    init_none_hash(sha256)
    num_blocks, samples = 256, []
    for seed in range(20):
        tokens = [(seed * 7919 + i) % 32000 for i in range(num_blocks * 32 + 1)]
        request = Request(
            f"r{seed}", tokens, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(32, sha256)
        )
        events = TierEvents([BlockLayout(("l0",), (ENTRY,), 32, 1, "")], num_ranks=1)
        events.attach(["ns"])
        keys = block_keys(request.block_hashes, events.layouts[0], 0, num_blocks)
        start = time.perf_counter()
        events.saving(request, 0, num_blocks)
        events.apply("ns", bytes([1 | STORED] * num_blocks), keys, num_blocks)
        assert len(events.take()) == 1
        samples.append((time.perf_counter() - start) / num_blocks * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()  # before the run, so that --help runs nothing
    result = run()
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"KV events: events on against off ({result['cpus']} CPUs, load {result['load_avg_1m']})")
    for op, what in (("lookup", "lookup of a 4,096-key prefix"), ("save", "reserve + commit of 64 entries")):
        r = result[op]
        print(
            f"  {what:31} off: median {r['off_ms']:.3f} ms (p99 {r['off_p99_ms']:.3f})  on: median {r['on_ms']:.3f} ms"
            f" (p99 {r['on_p99_ms']:.3f})  (target on <= off + 10%: {verdict(r['within_target'])})"
        )
    print(f"  journal records read by the watcher: {result['journal_records_read']}")
    if result["engine_side_us_per_block"] is not None:
        print(f"  engine side, per saved block (described + announced): {result['engine_side_us_per_block']:.1f} us")


if __name__ == "__main__":
    main()
