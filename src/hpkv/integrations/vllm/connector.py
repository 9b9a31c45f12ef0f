"""HpkvConnectorV1: vLLM V1's KV connector for HPKV, a thin shell over the two halves.

    --kv-transfer-config '{"kv_connector":"HpkvConnectorV1", "kv_role":"kv_both"}'

with VLLM_ENABLE_HPKV=1. Owns only the choice of half: the engine core's instance runs
`HpkvScheduler` (behind `guard.GuardedScheduler`: a bug there is a miss, not a stopped engine),
registered with the server as the engine starts; each worker's runs `HpkvWorker`. Extra
config: `"hpkv.async_save"` (true/false; default: asynchronous saves on accelerators) and
`"hpkv.fail_on_load_error"` (default false: HPKV is a cache, so vLLM's kv_load_failure_policy
is set to "recompute"). With vLLM's KV events on, the scheduler half's `eventfeed.EventFeed`
publishes HPKV's tiers through `take_events`. Knows nothing of keys, leases or copies.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ...config import load_settings
from ...errors import ConfigError, HpkvError
from . import layout as lay
from .connectorstats import HpkvConnectorStats, HpkvPromMetrics
from .guard import GuardedScheduler
from .metadata import HpkvConnectorMetadata

if TYPE_CHECKING:  # each half is imported only by the process that runs it
    from .worker import HpkvWorker

log = logging.getLogger("hpkv.vllm")

_H = TypeVar("_H")
_DRAIN_S = 30.0  # before sleep mode frees the KV cache, for the saves still copying from it


class HpkvConnectorV1(KVConnectorBase_V1, SupportsHMA):
    # Every method is KVConnectorBase_V1's or SupportsHMA's (vLLM calls each): each delegates to
    # a half. SupportsHMA keeps vLLM's hybrid KV cache manager on: one KV cache group per kind of
    # layer (full attention, sliding window), each in namespaces of its own (layout.py).
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = load_settings()
        if role == KVConnectorRole.SCHEDULER:
            for warning in settings.warnings:  # a mistyped key, a config file that is not there
                log.warning("%s", warning)
        if not settings.enable_vllm:
            raise ConfigError(
                "HpkvConnectorV1 was requested in --kv-transfer-config but HPKV is not enabled: set "
                "VLLM_ENABLE_HPKV=1 (environment or HPKV config file), or remove the connector"
            )
        self._scheduler: GuardedScheduler | None = None
        self._worker: HpkvWorker | None = None
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if role == KVConnectorRole.SCHEDULER:
            if not extra.get("hpkv.fail_on_load_error", False):
                # Read by the Scheduler right after it builds this connector (scheduler.py).
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            from .scheduler import HpkvScheduler

            scheduler = HpkvScheduler(vllm_config, kv_cache_config, settings)
            try:  # now, while the engine starts (its workers started the server), not on its first request;
                scheduler.namespaces()  # later if the model's identity is not known yet
            except HpkvError as exc:  # tried again on the first lookup
                log.warning("HPKV server unavailable to the scheduler at start: %s", exc)
            self._scheduler = GuardedScheduler(scheduler)
        else:
            from .worker import HpkvWorker

            async_saves = extra.get("hpkv.async_save")  # default: asynchronous on accelerators
            self._worker = HpkvWorker(
                vllm_config,
                kv_cache_config,
                settings,
                _this_rank(vllm_config),
                None if async_saves is None else bool(async_saves),
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, not lost work

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return lay.REQUIRED_LAYOUT

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        _side(self._worker, "worker").register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33 on calls this before sleep mode frees the KV cache: no save may still read it.
        if self._worker is not None and not self._worker.saves.drain(_DRAIN_S):
            log.warning("HPKV saves still copying after %.0f s; vLLM frees the KV cache they read", _DRAIN_S)

    def restore_kv_caches(self) -> None:
        return None  # woken, vLLM maps the KV cache at the same addresses: the views still hold

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # Before the step's loads and forward pass write into the blocks it allocated.
        if isinstance(kv_connector_metadata, HpkvConnectorMetadata) and kv_connector_metadata.allocated:
            _side(self._worker, "worker").fence(kv_connector_metadata.allocated)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, HpkvConnectorMetadata) and meta.loads:
            _side(self._worker, "worker").start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None  # whole blocks are saved in wait_for_save, after every layer is computed

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, HpkvConnectorMetadata) and meta.saves:
            _side(self._worker, "worker").wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker else set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Hybrid models' loads are asynchronous: a failed one ends in failed_recving (recomputed).
        done, failed = self._worker.take_recving() if self._worker else (set(), set())
        return KVConnectorTransferResults(finished_sending=set(), finished_recving=done | failed, failed_recving=failed)

    def build_connector_worker_meta(self):
        # The step's number, for the scheduler to settle the holds of its saves (pending.py).
        meta = getattr(self, "_connector_metadata", None) if self._worker else None
        if isinstance(meta, HpkvConnectorMetadata) and (meta.loads or meta.hold):
            return self._worker.worker_meta(meta.seq)
        return None

    def get_kv_connector_stats(self) -> HpkvConnectorStats | None:
        half = self._worker or (self._scheduler.scheduler if self._scheduler else None)
        return half.take_stats() if half else None

    def shutdown(self) -> None:
        for half in (self._worker, self._scheduler.scheduler if self._scheduler else None):
            if half is not None:
                try:
                    half.shutdown()
                except HpkvError:
                    pass

    # -- scheduler side: guarded (guard.py) ---------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return _side(self._scheduler, "scheduler").get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        _side(self._scheduler, "scheduler").update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        return _side(self._scheduler, "scheduler").hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return _side(self._scheduler, "scheduler").build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        _side(self._scheduler, "scheduler").update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        _side(self._scheduler, "scheduler").request_finished(request)
        return False, None

    def request_finished_all_groups(
        self, request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def reset_cache(self) -> bool | None:
        return _side(self._scheduler, "scheduler").reset_cache()

    def take_events(self):
        # Called by vLLM every step; with KV events off (its default) there is no feed: nothing runs.
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def has_pending_push_work(self) -> bool:
        # KV events of HPKV's tiers waiting: vLLM steps an idle engine once more to publish them.
        return self._scheduler is not None and self._scheduler.has_events()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HpkvConnectorStats | None:
        return HpkvConnectorStats(data=dict(data)) if data is not None else HpkvConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HpkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _this_rank(vllm_config) -> int:
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    tp_size = vllm_config.parallel_config.tensor_parallel_size
    return get_pp_group().rank_in_group * tp_size + get_tensor_model_parallel_rank()


def _side(half: _H | None, name: str) -> _H:
    """vLLM calls a side's methods only on the instance made for that side."""
    assert half is not None, f"a {name}-side call on the other side's connector"
    return half
