"""The scheduler half of HpkvConnectorV1: decides what to load and what to save.

For a new request it looks up the blocks past vLLM's own prefix-cache hit in every rank's
namespace (device > DRAM > storage: vLLM has already taken its own hits), applies
VLLM_HPKV_TOKEN_THRESHOLD, and leases the hit entries, which pins them in the shared pool and
promotes storage hits into DRAM. Only once every promotion is done does it tell vLLM how many
tokens HPKV supplies, so a load it announces cannot fail: the worker copies from pinned memory.
While promotions run it answers None ("ask again"), which keeps the request waiting without
stalling the engine. Every full block the engine computes (prompt and generated tokens) is
sent to the workers for saving, once.

HPKV faults (server gone, timeouts) make a lookup a miss: the engine recomputes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from ...config import Settings
from ...errors import HpkvError
from ...server.client import Client, LeaseHandle
from ...store import Tier
from . import layout as lay
from .metadata import HpkvConnectorMetadata, HpkvConnectorStats, LoadJob, SaveJob

log = logging.getLogger("hpkv.vllm.scheduler")

DEFAULT_THRESHOLD = 1204
PROMOTION_DEADLINE_S = 30.0
_POLL_S = 0.002


@dataclass
class _Req:
    request: object
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0
    lease_start: int = -1
    leases: dict[int, LeaseHandle] = field(default_factory=dict)
    tiers: tuple[Tier, ...] = ()
    leased_at: float = 0.0
    num_load_blocks: int = 0


class HpkvScheduler:
    def __init__(self, vllm_config, kv_cache_config, settings: Settings) -> None:
        self.layout = lay.block_layout(vllm_config, kv_cache_config)
        self.block_size = self.layout.block_size
        self.descs = [lay.namespace(vllm_config, self.layout, rank) for rank in range(lay.world_ranks(vllm_config))]
        self.client = Client(settings.pool.dir, kind="vllm-scheduler")
        self.threshold = self._threshold(settings)
        self.stats = HpkvConnectorStats()
        self._ns: list[str] | None = None
        self._reqs: dict[str, _Req] = {}
        self._pending_loads: list[LoadJob] = []
        _warn_if_hashes_unstable(vllm_config)

    @staticmethod
    def _threshold(settings: Settings) -> int:
        if settings.token_threshold is None:
            log.warning("VLLM_HPKV_TOKEN_THRESHOLD=auto: the measured cost model is not in this version yet; "
                        "using the documented default %d", DEFAULT_THRESHOLD)
            return DEFAULT_THRESHOLD
        log.info("HPKV loads hits of at least %d tokens (VLLM_HPKV_TOKEN_THRESHOLD)", settings.token_threshold)
        return settings.token_threshold

    def _namespaces(self) -> list[str]:
        if self._ns is None:
            self._ns = [self.client.register(desc) for desc in self.descs]
        return self._ns

    # -- lookups ------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _Req(request)
        start = num_computed_tokens // self.block_size
        stop = (request.num_tokens - 1) // self.block_size  # vLLM computes at least the last token
        if stop - start <= 0 or (stop - start) * self.block_size < self.threshold:
            self._release(state)
            return 0, False
        try:
            if state.leases and state.lease_start == start:
                ready = self._ready(state)
            else:
                ready = self._lease(state, start, stop)
        except HpkvError as exc:
            self._fault(state, exc)
            return 0, False
        if ready is None:
            return None, False  # promotions from storage still running: ask again next step
        if ready * self.block_size < self.threshold:
            if ready:
                self.stats.add("skipped_below_threshold", 1)
                self.stats.add("skipped_tokens", ready * self.block_size)
                log.debug("request %s: HPKV hit of %d tokens is below the threshold %d; recomputing",
                          request.request_id, ready * self.block_size, self.threshold)
            self._release(state)
            return 0, False
        state.num_load_blocks = ready
        return ready * self.block_size, False

    def _lease(self, state: _Req, start: int, stop: int) -> int | None:
        self._release(state)
        keys = lay.block_keys(state.request.block_hashes, self.layout, start, stop)
        namespaces = self._namespaces()
        hits = [self.client.lookup(ns, keys) for ns in namespaces]
        self.stats.add("lookups", 1)
        num_hit = min(hit.num_hit for hit in hits)
        if num_hit * self.block_size < self.threshold:
            if num_hit:
                self.stats.add("skipped_below_threshold", 1)
                self.stats.add("skipped_tokens", num_hit * self.block_size)
                log.debug("request %s: HPKV hit of %d tokens is below the threshold %d; recomputing",
                          state.request.request_id, num_hit * self.block_size, self.threshold)
            return 0
        state.tiers = tuple(max(hit.tiers[i] for hit in hits) for i in range(num_hit))
        state.leases = {rank: self.client.lease(ns, keys[:num_hit]) for rank, ns in enumerate(namespaces)}
        state.lease_start = start
        state.leased_at = time.monotonic()
        return self._ready(state)

    def _ready(self, state: _Req) -> int | None:
        """Leading entries ready on every rank, or None while promotions run."""
        pending = False
        for lease in state.leases.values():
            if lease.num_ready is None and self.client.wait(lease, timeout_s=_POLL_S) is None:
                pending = True
        if pending:
            if time.monotonic() - state.leased_at > PROMOTION_DEADLINE_S:
                log.warning("HPKV promotions for request %s took over %.0f s; recomputing",
                            state.request.request_id, PROMOTION_DEADLINE_S)
                self._release(state)
                return 0
            return None
        return min(lease.num_ready for lease in state.leases.values())

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _Req(request)
        if num_external_tokens <= 0:
            return
        num_blocks = num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0][state.lease_start : state.lease_start + num_blocks]
        keys = lay.block_keys(state.request.block_hashes, self.layout, state.lease_start,
                              state.lease_start + num_blocks)
        self._pending_loads.append(LoadJob(request.request_id, keys, list(block_ids)))
        tiers = state.tiers[:num_blocks]
        self.stats.add("hit_tokens_dram", tiers.count(Tier.DRAM) * self.block_size)
        self.stats.add("hit_tokens_storage", tiers.count(Tier.STORAGE) * self.block_size)
        log.debug("request %s: loading %d tokens from HPKV (%d from DRAM, %d from storage)", request.request_id,
                  num_external_tokens, tiers.count(Tier.DRAM) * self.block_size,
                  tiers.count(Tier.STORAGE) * self.block_size)

    def hit_sources(self, request, num_external_tokens: int) -> dict[str, int]:
        state = self._reqs.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return {}
        tiers = state.tiers[: num_external_tokens // self.block_size]
        return {"host": tiers.count(Tier.DRAM) * self.block_size,
                "disk": tiers.count(Tier.STORAGE) * self.block_size}

    # -- saves --------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> HpkvConnectorMetadata:
        meta = HpkvConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0]) if new.block_ids else []
            state.saved_blocks = max(state.saved_blocks, new.num_computed_tokens // self.block_size)
            self._add_saves(meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._add_saves(meta, req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _add_saves(self, meta: HpkvConnectorMetadata, req_id: str, state: _Req, num_tokens: int) -> None:
        full = min(num_tokens // self.block_size, len(state.block_ids))
        keys = lay.block_keys(state.request.block_hashes, self.layout, state.saved_blocks, full)
        if keys:
            stop = state.saved_blocks + len(keys)
            meta.saves.append(SaveJob(req_id, keys, state.block_ids[state.saved_blocks : stop]))
            state.saved_blocks = stop

    # -- end of requests, resets, faults ------------------------------------------------------

    def request_finished(self, request) -> None:
        state = self._reqs.pop(request.request_id, None)
        if state is not None:
            self._release(state)

    def reset_cache(self) -> bool:
        """Clear this engine's entries from the DRAM tier (storage stays), as vLLM's
        /reset_prefix_cache?reset_external=true asks."""
        for state in self._reqs.values():
            self._release(state)
        try:
            for ns in self._namespaces():
                self.client.clear(memory=True, storage=False, ns=ns)
        except HpkvError as exc:
            log.warning("HPKV reset: the server is not reachable (%s); its DRAM tier is gone with it", exc)
        return True

    def _release(self, state: _Req) -> None:
        leases, state.leases, state.lease_start = state.leases, {}, -1
        for lease in leases.values():
            try:
                self.client.release(lease)
            except HpkvError:
                pass  # a vanished server's leases vanish with it

    def _fault(self, state: _Req, exc: HpkvError) -> None:
        self.stats.add("server_errors", 1)
        log.warning("HPKV lookup failed, recomputing: %s", exc)
        state.leases, state.lease_start = {}, -1

    def take_stats(self) -> HpkvConnectorStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, HpkvConnectorStats()
        return stats

    def shutdown(self) -> None:
        for state in self._reqs.values():
            self._release(state)
        self.client.close()


def _warn_if_hashes_unstable(vllm_config) -> None:
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
        log.warning("--prefix-caching-hash-algo %s without PYTHONHASHSEED makes vLLM's block hashes random per "
                    "process: KV saved by HPKV will never hit after a restart or from another engine. Fix: "
                    "export PYTHONHASHSEED=<one value for every engine> or use sha256", algo)
