"""The scheduler half of HpkvConnectorV1: decides what to load and what to save.

Owns each request's lookup and leases (`requests.RequestState`), the load decision (the
policy from `loadpolicy.load_policy`: a fixed threshold or `auto`) and the save jobs of every
step; reading a step's output and settling its held saves is in `outputs.py`, what each KV
cache group of a hybrid model loads and saves in `groups.py` (all groups of a hit, or none; such
loads are asynchronous to vLLM, so that a failure reaches it as failed_recving).
Primitives: `Client.lease_many/lookup_many/wait_all/release/settle`, a constant number per request
whatever the ranks, KV cache groups and blocks (`hitplan.py`). A load is announced only once every promotion
is done (None, "ask again", until then), so the worker copies from pinned memory and a load
cannot fail for want of an entry. HPKV faults make a lookup a miss: the engine recomputes.
Knows nothing of the worker's copies or of the server's store.
"""

from __future__ import annotations

import logging
import time

from ...config import Settings
from ...errors import HpkvError
from ...server.client import Client
from ...tiers import HOLD_TIMEOUT_S, Tier
from . import compat, connectorstats, eventfeed, groups, hitplan, loadpolicy, mamba, modelid, optout, outputs, probes
from . import layout as lay
from .metadata import HpkvConnectorMetadata, LoadJob
from .requests import RequestState
from .table import RequestTable

log = logging.getLogger("hpkv.vllm.scheduler")

PROMOTION_DEADLINE_S = 30.0
# How long the server waits for a request's promotions within one `LeaseWait`, while vLLM's step
# waits: short, the request is asked again next step.
READY_WAIT_S = 0.002


class HpkvScheduler:
    feed: eventfeed.EventFeed | None = None  # KV events of HPKV's tiers (only with vLLM's on)

    def __init__(self, vllm_config, kv_cache_config, settings: Settings) -> None:
        self.layouts = lay.group_layouts(vllm_config, kv_cache_config)
        self.layout = self.layouts[0]
        self.block_size = self.layout.block_size
        self.num_ranks = lay.world_ranks(vllm_config)
        # Hybrid models load asynchronously: vLLM takes their load failures only as failed_recving.
        self.async_loads = len(self.layouts) > 1
        self.vllm_config = vllm_config
        self.descs: list[lay.NamespaceDesc] = []  # once the identity is known
        self.identity = modelid.identity_task(vllm_config, settings.model_id)  # until known: no loads, saves
        self._lora_logged = getattr(vllm_config, "lora_config", None) is not None
        if self._lora_logged:
            log.info(
                "HPKV does not cache requests with a LoRA adapter (vLLM keys their KV by the adapter's name "
                "and path, not its content): they are computed by vLLM alone; base-model requests are cached"
            )
        self.client = Client(settings.pool.dir, kind="vllm-scheduler", trusted_uids=settings.server_allow_uids)
        self.stats = connectorstats.HpkvConnectorStats()
        self._ns: list[str] | None = None
        self.policy = loadpolicy.load_policy(
            settings,
            vllm_config.model_config,
            lay.moved_per_block(self.layouts),
            self.num_ranks,
            lambda: probes.empty_lookup(self.client),
            lay.moved_per_hit(self.layouts),
        )
        self.table = RequestTable()  # requests, loads in flight, pending saves: shared with outputs.py
        self._pending_loads: list[LoadJob] = []
        self._step_loads: list[LoadJob] = []  # the loads of the step being built
        self.kv_cache_manager = None  # vLLM's, once bound: to un-hash blocks that failed to load
        if eventfeed.enabled(vllm_config):  # --kv-events-config; attached at start (`namespaces`), not on a request
            self.feed = eventfeed.EventFeed(self.layouts, self.num_ranks, self.client, self.namespaces, self.identity)
        modelid.warn_if_hashes_unstable(vllm_config)

    def namespaces(self) -> list[str] | None:
        """This engine's namespaces, registered on first need; None while the model's identity
        is not known (a namespace another engine could share may not be read or written yet)."""
        identity = self.identity.get()
        if self._ns is None and identity is not None:
            if not self.descs:
                self.descs = lay.namespaces(self.vllm_config, self.layouts, identity)
                log.info("HPKV namespace model: %s", self.descs[0].model)
            namespaces = [self.client.register(desc) for desc in self.descs]
            if self.feed is not None:  # watched before any lease answer is read
                self.feed.attach(namespaces, self.descs)
            self._ns = namespaces
        return self._ns

    # -- lookups ------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self.table.state_of(request)
        if self._uncached(request, state):  # first: a LoRA request is not saved either
            return 0, False
        if state.load_failed:  # recomputed once, not looked up again (a broken entry would loop)
            return 0, False
        if not optout.may_load(request) or self.identity.get() is None:  # {"hpkv_load": false}
            return 0, False
        if compat.skips_external_kv(request):  # e.g. prompt logprobs: vLLM drops any hit
            state.release(self.client)
            return 0, False
        start = num_computed_tokens // self.block_size
        stop = (request.num_tokens - 1) // self.block_size  # vLLM computes at least the last token
        if stop - start <= 0 or not self.policy.may_pay(start * self.block_size, stop - start):
            state.release(self.client)
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
        num_load = ready if self.policy.may_pay(start * self.block_size, ready) else 0  # all in DRAM now
        loadpolicy.count_skipped(self.stats, self.policy, state.request.request_id, self.block_size, ready, num_load)
        if not num_load:
            state.release(self.client)
            return 0, False
        state.num_load_blocks = num_load
        return num_load * self.block_size, self.async_loads

    def _uncached(self, request, state: RequestState) -> bool:
        """LoRA requests are neither looked up nor saved: vLLM's block hashes name the adapter by
        name and path, not by content, so an adapter changed at its path (or another one of the
        same name and path on another node) would be served the old one's KV."""
        if getattr(request, "lora_request", None) is None:
            return False
        state.uncached = True
        if not self._lora_logged:
            self._lora_logged = True
            log.info(
                "HPKV does not cache requests with a LoRA adapter (their KV is keyed by the adapter's name "
                "and path, not its content): they are computed by vLLM alone"
            )
        return True

    def _lease(self, state: RequestState, start: int, stop: int) -> int | None:
        """Lease the hit of blocks [start, stop) on every rank and group: one `Lease` (a
        full-attention model reads its hit from it), or one `Lookup` then one `Lease` (a model
        with sliding-window or state groups, which lease part of a hit whose length they must
        know first)."""
        state.release(self.client)
        keys = lay.block_keys(state.request.block_hashes, self.layout, start, stop)
        namespaces = self.namespaces() or []  # known: get_num_new_matched_tokens asked
        plan = lambda hit: self.policy.plan(start * self.block_size, hit)  # noqa: E731
        state.asked_at = time.perf_counter()
        if hitplan.needs_lookup(self.layouts):
            num_hit, tiers = hitplan.plan_hit(hitplan.looked_up(self.client, self.layouts, namespaces, keys), plan)
            ranges = groups.lease_ranges(self.layouts, self.num_ranks, len(tiers)) if tiers else []
            leases = self.client.lease_many([(ns, keys[a:b]) for ns, (a, b) in zip(namespaces, ranges)])
            sizes = [b - a for a, b in ranges]
        else:
            leases = self.client.lease_many([(ns, keys) for ns in namespaces])
            hit = hitplan.leased_tiers(leases)
            num_hit, tiers = len(hit), hit[: plan(hit)]
            sizes = [len(tiers)] * len(leases)
        if self.feed is not None:
            self.feed.leased(state.request, start, leases, namespaces)
        state.leases, state.lease_sizes = dict(enumerate(leases)), dict(enumerate(sizes))
        self.stats.add("lookups", 1)
        if not num_hit:
            log.debug(
                "request %s: no HPKV hit: block %d is in no tier (never saved, or evicted)",
                state.request.request_id,
                start,
            )
        req_id = state.request.request_id
        loadpolicy.count_skipped(self.stats, self.policy, req_id, self.block_size, num_hit, len(tiers))
        if not tiers:
            state.release(self.client)
            return 0
        state.tiers = tiers
        state.num_promoting = tiers.count(Tier.STORAGE)
        state.polled_at = state.asked_at
        state.lease_start = start
        state.leased_at = time.monotonic()
        return self._ready(state)

    def _ready(self, state: RequestState) -> int | None:
        """Leading entries ready on every rank, or None while promotions run (asked in one
        `LeaseWait` over the request's leases, which the server answers within READY_WAIT_S). A
        lease whose connection has been dropped (and maybe opened again) pins nothing any more:
        a miss, and the rest of the request's leases go with it."""
        counts = state.ready_counts(self.client, READY_WAIT_S)
        if counts is None:
            state.release(self.client)
            return 0
        if time.monotonic() - state.leased_at > PROMOTION_DEADLINE_S and None in counts:
            log.warning(
                "HPKV promotions for request %s took over %.0f s; recomputing",
                state.request.request_id,
                PROMOTION_DEADLINE_S,
            )
            state.release(self.client)
            return 0
        if None in counts:
            state.polled_at = time.perf_counter()
            return None
        timed = state.take_promotion_time(READY_WAIT_S) if state.num_promoting else None
        if timed is not None:  # (storage blocks, seconds)
            self.policy.promoted(timed[0] * lay.moved_per_block(self.layouts).entry_bytes * self.num_ranks, timed[1])
        sizes = [state.lease_sizes.get(i, 0) for i in state.leases]
        if all(count is not None and count >= size for count, size in zip(counts, sizes)):
            return len(state.tiers)
        if self.async_loads or self.layout.window_blocks:  # all or nothing per boundary: a miss
            state.release(self.client)
            return 0
        return min(min(c for c in counts if c is not None), len(state.tiers))  # none is None by now

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self.table.state_of(request)
        if num_external_tokens <= 0:  # vLLM loads nothing after all (it may trim a hit): unpin it
            state.release(self.client)
            return
        num_blocks = num_external_tokens // self.block_size
        keys = lay.block_keys(
            state.request.block_hashes, self.layout, state.lease_start, state.lease_start + num_blocks
        )
        self._pending_loads += groups.load_jobs(
            request.request_id,
            self.layouts,
            keys,
            blocks.get_block_ids(),
            state.lease_start,
            self._null_block(),
            self.async_loads,
        )
        tiers = state.tiers[:num_blocks]
        self.stats.add("hit_tokens_dram", tiers.count(Tier.DRAM) * self.block_size)
        self.stats.add("hit_tokens_storage", tiers.count(Tier.STORAGE) * self.block_size)
        log.debug(
            "request %s: loading %d tokens from HPKV (%d from DRAM, %d from storage)",
            request.request_id,
            num_external_tokens,
            tiers.count(Tier.DRAM) * self.block_size,
            tiers.count(Tier.STORAGE) * self.block_size,
        )

    def forget_lookup(self, request) -> None:
        """vLLM got no answer for `request` (a bug): what it leased is not needed."""
        if (state := self.table.get(request.request_id)) is not None:
            state.release(self.client)

    def fail_load(self, request, blocks, num_external_tokens: int) -> None:
        """vLLM counts `num_external_tokens` as loaded, but no load was planned for them (a bug):
        a load of no entries into their blocks, which the workers report failed and vLLM
        recomputes."""
        if num_external_tokens <= 0:
            return
        state = self.table.get(request.request_id)
        start = state.lease_start if state is not None and state.lease_start >= 0 else 0
        stop = start + -(-num_external_tokens // self.block_size)
        job = LoadJob(request.request_id, [], list(blocks.get_block_ids()[0][start:stop]), notify=self.async_loads)
        self._pending_loads.append(job)

    def hit_sources(self, request, num_external_tokens: int) -> dict[str, int]:
        state = self.table.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return {}
        tiers = state.tiers[: num_external_tokens // self.block_size]
        return {"host": tiers.count(Tier.DRAM) * self.block_size, "disk": tiers.count(Tier.STORAGE) * self.block_size}

    # -- saves --------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> HpkvConnectorMetadata:
        self._step_loads, self._pending_loads = self._pending_loads, []
        seq, hold = self.table.begin_step(bool(self._step_loads))
        meta = HpkvConnectorMetadata(
            loads=self._step_loads,
            allocated=outputs.allocated_blocks(scheduler_output),
            seq=seq,
            hold=hold,
            identity=self.identity.get(),
        )
        self.table.loading(seq, ((job.req_id, job.block_ids) for job in meta.loads))
        scheduled = scheduler_output.num_scheduled_tokens
        offers = mamba.offers_of(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            state = self.table.get(new.req_id)
            if state is None:
                continue
            state.set_blocks(new.block_ids)
            state.saved_blocks = max(state.saved_blocks, new.num_computed_tokens // self.block_size)
            num_tokens = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._add_saves(meta, new.req_id, state, num_tokens, offers.get(new.req_id, ()))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.table.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in compat.resumed_req_ids(cached):
                state.set_blocks(new_ids)
            elif new_ids:
                state.add_blocks(new_ids)
            num_tokens = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._add_saves(meta, req_id, state, num_tokens, offers.get(req_id, ()))
        if self.policy.learns:
            self.policy.step_built(outputs.chunks(scheduler_output), len(meta.loads))
        return meta

    def bare_meta(self, scheduler_output) -> HpkvConnectorMetadata:
        """The step's metadata when build_connector_meta failed (a bug): the loads vLLM counts
        on still run, nothing is saved. What the step allocated is still needed: without it the
        workers cannot fence an earlier step's save, which could publish a block being
        overwritten; a vLLM whose step this cannot read is better stopped."""
        return HpkvConnectorMetadata(
            loads=self._step_loads, allocated=outputs.allocated_blocks(scheduler_output), seq=self.table.seq
        )

    def update_connector_output(self, connector_output) -> None:
        """A step's output is back, with the workers' stats of that step (summed over ranks):
        settle the holds it decides, and learn from its timings."""
        try:
            outputs.settle(
                self.table, self.client, self.stats, self.kv_cache_manager, self.block_size, connector_output
            )
        except Exception:  # a bug here must not stop the engine: the holds time out on the server
            log.exception(
                "HPKV could not settle this step's held saves; the server aborts them after %.0f s", HOLD_TIMEOUT_S
            )
        if not self.policy.learns:
            return
        data = getattr(connector_output.kv_connector_stats, "data", None) or {}
        ranks = self.num_ranks
        # The time the step waited for saves (asynchronous saves run beside the next step).
        load_s, save_s = data.get("load_time_s", 0) / ranks, data.get("save_wait_s", 0) / ranks
        self.policy.step_done(load_s + save_s, load_s, data.get("loaded_bytes", 0) / ranks)

    def _add_saves(
        self, meta: HpkvConnectorMetadata, req_id: str, state: RequestState, num_tokens: int, offers=()
    ) -> None:
        if state.uncached or not optout.may_save(state.request) or meta.identity is None:  # {"hpkv_save": false}
            return
        group_ids = state.group_block_ids()
        lens = (len(ids) for ids, layout in zip(group_ids, self.layouts) if not layout.state)
        full = min(num_tokens // self.block_size, *lens)
        hashes, null = state.request.block_hashes, self._null_block()
        keys, jobs = groups.save_jobs(req_id, self.layouts, hashes, group_ids, state.saved_blocks, full, null)
        jobs += mamba.offered_saves(req_id, self.layouts, hashes, offers, null)
        stop = state.saved_blocks + len(keys)
        if self.feed is not None and keys:
            self.feed.saving(state.request, state.saved_blocks, stop)
        meta.saves += jobs
        if meta.hold and jobs:
            held = list(dict.fromkeys(key for job in jobs for key in job.keys))
            self.table.pending.add(meta.seq, req_id, held, state.block_ids[:stop], state.saved_blocks)
        state.saved_blocks = stop

    # -- end of requests, resets, faults ------------------------------------------------------

    def request_finished(self, request) -> None:
        state = self.table.pop(request.request_id)
        if state is not None:
            state.release(self.client)

    def reset_cache(self) -> bool:
        """Clear this engine's entries from the DRAM tier (storage stays), as vLLM's
        /reset_prefix_cache?reset_external=true asks."""
        for state in self.table.states():
            state.release(self.client)
        try:
            for ns in self.namespaces() or []:
                self.client.clear(dram=True, storage=False, ns=ns)
        except HpkvError as exc:
            log.warning("HPKV reset: the server is not reachable (%s); its DRAM tier is gone with it", exc)
        return True

    def _null_block(self) -> int:
        """The id of vLLM's null block (no memory: the blocks a sliding window no longer reads)."""
        pool = getattr(self.kv_cache_manager, "block_pool", None)
        return pool.null_block.block_id if pool is not None else 0

    def _fault(self, state: RequestState, exc: HpkvError) -> None:
        self.stats.add("server_errors", 1)
        log.warning("HPKV lookup failed, recomputing: %s", exc)
        state.release(self.client)  # the leases of the ranks before the one that failed

    def take_stats(self) -> connectorstats.HpkvConnectorStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, connectorstats.HpkvConnectorStats()
        return stats

    def shutdown(self) -> None:
        self.policy.close()
        if self.feed is not None:
            self.feed.close()
        for state in self.table.states():
            state.release(self.client)
        for settle in self.table.pending.abandon():  # not left pinned until the server's timeout
            try:
                self.client.settle(settle.hold, settle.abort)
            except HpkvError:
                break
        self.client.close()
