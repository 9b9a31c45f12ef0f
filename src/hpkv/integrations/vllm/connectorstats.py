"""HPKV counters in vLLM's own /metrics (the frontend process builds this from the stats the
engine core sends it)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

_COUNTERS = {
    "hit_tokens_dram": "Prompt tokens loaded from HPKV's DRAM pool",
    "hit_tokens_storage": "Prompt tokens loaded from HPKV's storage tier",
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


class HpkvPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_cls = metric_types[Counter]
        self._counters = {}
        for name, doc in _COUNTERS.items():
            metric = counter_cls(name=f"vllm:hpkv_{name}", documentation=doc, labelnames=labelnames)
            for engine_idx, values in per_engine_labelvalues.items():
                self._counters[(engine_idx, name)] = metric.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self._counters.get((engine_idx, name))
            if counter is not None and value:
                counter.inc(value)
