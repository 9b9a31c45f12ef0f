"""What the scheduler half tells the worker halves each step, and the connector's stats.

Both travel between processes by pickle/msgpack: plain types only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ...identity import ModelIdentity


@dataclass
class LoadJob:
    """Copy the entries of `keys` into `block_ids`. The scheduler holds leases on them; each
    worker takes its own lease for the copy, so its bytes are pinned for exactly as long as it
    reads them, whatever happens to the scheduler's connection."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    group: int = 0  # the KV cache group (and namespace) of the blocks
    # An asynchronous load (hybrid models): the request waits for it, and the workers report it
    # in finished_recving, with failed_recving when it failed (vLLM then recomputes it).
    notify: bool = False


@dataclass
class SaveJob:
    """Save full blocks: the workers reserve, copy and commit (the server skips held keys)."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    group: int = 0


@dataclass
class HpkvConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # Blocks allocated to requests in this step: the only blocks vLLM can overwrite that an
    # earlier step's save may still be reading (the worker fences on them).
    allocated: list[int] = field(default_factory=list)
    seq: int = 0  # the step's number, sent back in HpkvWorkerMeta when it loads or holds
    # Reserve this step's saves in this hold and do not commit them: the scheduler settles it
    # once it knows no load they depend on failed (holds.py). "": commit them.
    hold: str = ""
    # The model's identity once the scheduler knows it (the workers name their namespaces by it);
    # None before: no loads or saves then.
    identity: ModelIdentity | None = None


_COUNTERS = (
    "lookups",
    "hit_tokens_dram",
    "hit_tokens_storage",
    "skipped_below_threshold",
    "skipped_tokens",
    "loaded_blocks",
    "loaded_bytes",
    "load_time_s",
    "saved_blocks",
    "saved_bytes",
    "save_time_s",
    "load_failures",
    "server_errors",
    "save_wait_s",
    "save_fences",
    "held_saves_aborted",
)


@dataclass
class HpkvConnectorStats(KVConnectorStats):
    """Counters summed over workers and the scheduler for one logging interval."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, float] = dict.fromkeys(_COUNTERS, 0)  # counts and seconds

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
