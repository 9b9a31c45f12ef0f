"""The load policy of one vLLM engine: VLLM_HPKV_TOKEN_THRESHOLD as a fixed threshold, or `auto`,
a cost model seeded at start-up by this machine's figures (`probes.py`) and refined by the
engine's own steps (`costmodel.py`).

Primitives: `load_policy` (the one the scheduler half asks), `auto_threshold`, `count_skipped`. Must not know
the scheduler's requests or the server beyond the one round trip it is handed.
"""

from __future__ import annotations

import logging

from ...config import Settings, StorageConfig
from ...costmodel import AffineCost, AutoThreshold, CostModel, FixedThreshold
from .probes import copy_cost, kappa_of, round_trip_s, storage_read_cost

log = logging.getLogger("hpkv.vllm.loadpolicy")

DEFAULT_THRESHOLD = 1204  # VLLM_HPKV_TOKEN_THRESHOLD's documented default: prefill's seed under auto


def auto_threshold(
    storage: StorageConfig,
    model_config,
    block_size: int,
    entry_bytes: int,
    num_ranks: int,
    empty_lookup,
    hit_bytes: int = 0,
) -> AutoThreshold:
    """VLLM_HPKV_TOKEN_THRESHOLD=auto for one engine, seeded by this machine's figures;
    `empty_lookup()` is one round trip to the server; a hit moves `entry_bytes` per block and
    `hit_bytes` more (a hybrid model's windows and states), per rank."""
    rtt_s = round_trip_s(empty_lookup)
    storage_cost = None
    if storage.enabled:  # a promotion: the lease, a poll, then one read per block and rank
        storage_cost = storage_read_cost(storage.path, 2 * rtt_s)
    model = CostModel(
        block_size,
        entry_bytes,
        num_ranks,
        kappa_of(model_config.hf_text_config),
        prefill=AffineCost(0.0, 0.0),
        storage=storage_cost,
        # on a load's critical path: the scheduler's lease, the worker's lease and release
        dram=copy_cost(3 * rtt_s),
        hit_bytes=hit_bytes,
    )
    model.seed_prefill(DEFAULT_THRESHOLD)
    return AutoThreshold(
        model,
        model_config.max_model_len,
        f"start-up estimates: server round trip {rtt_s * 1e3:.2f} ms, a host copy, a "
        f"storage read; prefill set to break even at the documented {DEFAULT_THRESHOLD} "
        f"tokens until the engine has computed a prompt",
    )


def load_policy(
    settings: Settings, model_config, layout, num_ranks: int, lookup, hit_bytes: int = 0
) -> FixedThreshold | AutoThreshold:
    """The load decision: VLLM_HPKV_TOKEN_THRESHOLD if set, else `auto` from start-up estimates."""
    if settings.token_threshold is not None:
        log.info("HPKV loads hits of at least %d tokens (VLLM_HPKV_TOKEN_THRESHOLD)", settings.token_threshold)
        return FixedThreshold(settings.token_threshold, layout.block_size)
    return auto_threshold(
        settings.storage, model_config, layout.block_size, layout.entry_bytes, num_ranks, lookup, hit_bytes
    )


def count_skipped(stats, policy, request_id: str, block_size: int, num_hit: int, num_load: int) -> None:
    """A hit of `num_hit` blocks of which the policy loads `num_load`: the rest counted as skipped."""
    if num_load < num_hit:
        stats.add("skipped_below_threshold", 1)
        stats.add("skipped_tokens", (num_hit - num_load) * block_size)
        log.debug(
            "request %s: HPKV hit of %d tokens, loading %d under %s; recomputing the rest",
            request_id,
            num_hit * block_size,
            num_load * block_size,
            policy.describe(),
        )
