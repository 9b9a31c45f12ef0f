"""The connector's counters: what each is, summed over the workers and the scheduler half for one
logging interval (`HpkvConnectorStats`, which travels to vLLM's frontend by pickle/msgpack: plain
types only), and how vLLM's own /metrics shows them (`HpkvPromMetrics`, built by the frontend
process). Must not know what the counters count beyond their names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# Every counter, and the help of its `vllm:hpkv_<name>` series (None: logged, not exported).
COUNTERS: dict[str, str | None] = {
    "lookups": None,
    "hit_tokens_dram": "Prompt tokens loaded from HPKV's DRAM pool",
    "hit_tokens_storage": "Prompt tokens loaded from HPKV's storage tier",
    "skipped_below_threshold": None,
    "skipped_tokens": (
        "HPKV-hit tokens recomputed because loading them would not pay: below "
        "VLLM_HPKV_TOKEN_THRESHOLD, or slower than recomputing under auto"
    ),
    "loaded_blocks": "Blocks copied from HPKV into the engine's KV cache",
    "saved_blocks": "Blocks saved from the engine's KV cache into HPKV",
    "loaded_bytes": "Bytes copied from HPKV into the engine's KV cache",
    "saved_bytes": "Bytes saved from the engine's KV cache into HPKV",
    "load_time_s": "Seconds spent copying blocks from HPKV",
    "save_time_s": "Seconds spent copying blocks into HPKV (beside the forward pass when saves are asynchronous)",
    "save_wait_s": "Seconds engine steps waited for HPKV saves (reservations, synchronous copies, fences)",
    "save_fences": "Steps that waited for an asynchronous save before overwriting the blocks it read",
    "load_failures": "Blocks HPKV could not load (recomputed)",
    "held_saves_aborted": "Blocks not saved because the step that computed them read a block that failed to load",
    "server_errors": "HPKV server calls that failed (treated as misses)",
}


@dataclass
class HpkvConnectorStats(KVConnectorStats):
    """Counters summed over workers and the scheduler for one logging interval."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, float] = dict.fromkeys(COUNTERS, 0)  # counts and seconds

    def add(self, name: str, value: float) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> HpkvConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, Any] = {
            "hpkv_lookups": d.get("lookups", 0),
            "hpkv_hit_tokens_dram": d.get("hit_tokens_dram", 0),
            "hpkv_hit_tokens_storage": d.get("hit_tokens_storage", 0),
            "hpkv_skipped_below_threshold": d.get("skipped_below_threshold", 0),
            "hpkv_loaded_blocks": d.get("loaded_blocks", 0),
            "hpkv_saved_blocks": d.get("saved_blocks", 0),
            "hpkv_load_failures": d.get("load_failures", 0),
            "hpkv_held_saves_aborted": d.get("held_saves_aborted", 0),
            "hpkv_save_fences": d.get("save_fences", 0),
            "hpkv_server_errors": d.get("server_errors", 0),
        }
        for kind in ("load", "save"):
            seconds, num_bytes = d.get(f"{kind}_time_s", 0), d.get(f"{kind}ed_bytes", 0)
            out[f"hpkv_{kind}_GBps"] = round(num_bytes / seconds / 1e9, 3) if seconds else 0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class HpkvPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_cls = metric_types[Counter]
        self._counters = {}
        for name, doc in COUNTERS.items():
            if doc is None:
                continue
            metric = counter_cls(name=f"vllm:hpkv_{name}", documentation=doc, labelnames=labelnames)
            for engine_idx, values in per_engine_labelvalues.items():
                self._counters[(engine_idx, name)] = metric.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self._counters.get((engine_idx, name))
            if counter is not None and value:
                counter.inc(value)
