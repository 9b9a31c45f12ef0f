"""HpkvConnectorV1: vLLM V1's KV connector for HPKV, a thin shell over the two halves.

    --kv-transfer-config '{"kv_connector":"HpkvConnectorV1", "kv_role":"kv_both"}'

with VLLM_ENABLE_HPKV=1. The scheduler-side instance (engine core) runs `HpkvScheduler`; each
worker's instance runs `HpkvWorker`. Loads are synchronous (before the forward pass of the step
that needs them, from entries already pinned in DRAM); saves start after the forward pass and,
on accelerators, copy beside the next one (`"hpkv.async_save"` in kv_connector_extra_config
overrides: true or false), except those a step after a load holds until the load is known good
(holds.py), which are copied in the step.
HPKV is a cache: a block it cannot load is recomputed, so the connector switches vLLM's
kv_load_failure_policy to "recompute" unless `"hpkv.fail_on_load_error": true` is given in
kv_connector_extra_config.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ...config import load_settings
from ...errors import ConfigError, HpkvError
from ...logutil import Throttle
from . import layout as lay
from .metadata import HpkvConnectorMetadata, HpkvConnectorStats

if TYPE_CHECKING:  # each half is imported only by the process that runs it
    from .scheduler import HpkvScheduler
    from .worker import HpkvWorker

log = logging.getLogger("hpkv.vllm")

_BUG_LOG_INTERVAL_S = 60.0


class HpkvConnectorV1(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = load_settings()
        if role == KVConnectorRole.SCHEDULER:
            for warning in settings.warnings:  # a mistyped key, a config file that is not there
                log.warning("%s", warning)
        if not settings.enable_vllm:
            raise ConfigError(
                "HpkvConnectorV1 was requested in --kv-transfer-config but HPKV is not enabled: set "
                "VLLM_ENABLE_HPKV=1 (environment or HPKV config file), or remove the connector")
        self._scheduler: HpkvScheduler | None = None
        self._worker: HpkvWorker | None = None
        self._bugs = Throttle()  # by entry point
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if role == KVConnectorRole.SCHEDULER:
            if not extra.get("hpkv.fail_on_load_error", False):
                # Read by the Scheduler right after it builds this connector (scheduler.py).
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            from .scheduler import HpkvScheduler

            self._scheduler = HpkvScheduler(vllm_config, kv_cache_config, settings)
        else:
            from .worker import HpkvWorker

            async_saves = extra.get("hpkv.async_save")  # default: asynchronous on accelerators
            self._worker = HpkvWorker(vllm_config, kv_cache_config, settings, _this_rank(vllm_config),
                                      None if async_saves is None else bool(async_saves))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, not lost work

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return lay.REQUIRED_LAYOUT

    @property
    def _worker_side(self) -> HpkvWorker:
        """vLLM calls the worker-side methods only on an instance made for a worker."""
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    @property
    def _scheduler_side(self) -> HpkvScheduler:
        """vLLM calls the scheduler-side methods only on the instance made for the scheduler."""
        assert self._scheduler is not None, "a scheduler-side call on a worker's connector"
        return self._scheduler

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self._worker_side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # Before the step's loads and forward pass write into the blocks it allocated.
        if isinstance(kv_connector_metadata, HpkvConnectorMetadata) and kv_connector_metadata.allocated:
            self._worker_side.fence(kv_connector_metadata.allocated)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, HpkvConnectorMetadata) and meta.loads:
            self._worker_side.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None  # whole blocks are saved in wait_for_save, after every layer is computed

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, HpkvConnectorMetadata) and meta.saves:
            self._worker_side.wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker else set()

    def build_connector_worker_meta(self):
        # The step's number, for the scheduler to settle the holds of its saves (holds.py).
        meta = getattr(self, "_connector_metadata", None) if self._worker else None
        if isinstance(meta, HpkvConnectorMetadata) and (meta.loads or meta.hold):
            return self._worker.worker_meta(meta.seq)
        return None

    def get_kv_connector_stats(self) -> HpkvConnectorStats | None:
        half = self._worker or self._scheduler
        return half.take_stats() if half else None

    def shutdown(self) -> None:
        for half in (self._worker, self._scheduler):
            if half is not None:
                try:
                    half.shutdown()
                except HpkvError:
                    pass

    # -- scheduler side -----------------------------------------------------------------------
    # vLLM's scheduler calls these from its engine core's loop: an exception escaping one of them
    # (a bug here, a vLLM that changed under us) would stop the engine. Each degrades instead,
    # as on a miss: vLLM recomputes what HPKV would have supplied.

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            return self._scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:
            self._bug("a lookup", lambda: self._scheduler_side.forget_lookup(request))
            return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        try:
            self._scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception:  # vLLM counts those tokens as loaded: the workers must report them failed
            self._bug("a load", lambda: self._scheduler_side.fail_load(request, blocks, num_external_tokens))

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        try:
            sources = self._scheduler_side.hit_sources(request, num_external_tokens)
            return {CacheHitSource(name): count for name, count in sources.items() if count}
        except Exception:
            self._bug("the hit sources")
            return {}

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        try:
            return self._scheduler_side.build_connector_meta(scheduler_output)
        except Exception:
            self._bug("a step's metadata")
            return self._scheduler_side.bare_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        try:
            self._scheduler_side.update_connector_output(connector_output)
        except Exception:
            self._bug("a step's output")

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        try:
            self._scheduler_side.request_finished(request)
        except Exception:  # its leases end with the connection, at the latest
            self._bug("a finished request")
        return False, None

    def reset_cache(self) -> bool | None:
        try:
            return self._scheduler_side.reset_cache()
        except Exception:
            self._bug("a cache reset")
            return False

    def _bug(self, what: str, *recover) -> None:
        """Called inside an `except`: log the exception with its traceback (the first of each
        kind, then at most one a minute: a bug on every step would flood the log), then run the
        `recover` steps, each as best it can."""
        missed = self._bugs.num_refused(what)
        if self._bugs.allows(time.monotonic(), _BUG_LOG_INTERVAL_S, what):
            log.exception("HPKV bug in %s (%d more since the last report); vLLM recomputes instead", what, missed)
        for step in recover:
            try:
                step()
            except Exception:  # already degrading: the traceback above is the one to read
                log.debug("HPKV could not recover from the bug in %s", what, exc_info=True)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HpkvConnectorStats | None:
        return HpkvConnectorStats(data=dict(data)) if data is not None else HpkvConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from .prom import HpkvPromMetrics

        return HpkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _this_rank(vllm_config) -> int:
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    tp_size = vllm_config.parallel_config.tensor_parallel_size
    return get_pp_group().rank_in_group * tp_size + get_tensor_model_parallel_rank()
