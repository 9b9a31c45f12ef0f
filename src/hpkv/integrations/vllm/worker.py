"""The worker half of HpkvConnectorV1: moves bytes between this rank's paged KV and the pool.

It decides nothing: the scheduler half says which blocks to load and which to save, with their
keys. Loads run in `start_load_kv`, before the forward pass of the
step that needs them; saves run in `wait_for_save`, after the forward pass computed the blocks,
straight into reserved pool slots, which the server then writes through to storage on its own
threads. A save that cannot happen (server gone, pool full) is skipped: a future miss, never an
error. A load that cannot happen is reported as failed blocks, which vLLM recomputes.
"""

from __future__ import annotations

import logging
import time

import torch

from ...config import Settings
from ...errors import HpkvError
from ...server.client import Client
from ...transfer.blocks import BlockCopier
from . import layout as lay
from .metadata import HpkvConnectorMetadata, HpkvConnectorStats

log = logging.getLogger("hpkv.vllm.worker")

LOAD_WAIT_S = 10.0  # promotions the scheduler saw done; only a server restart makes this wait


class HpkvWorker:
    def __init__(self, vllm_config, kv_cache_config, settings: Settings, rank: int) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.rank = rank
        self.layout = lay.block_layout(vllm_config, kv_cache_config)
        self.desc = lay.namespace(vllm_config, self.layout, rank)
        self.client = Client(settings.pool.dir, kind=f"vllm-worker-{rank}", prefault=settings.pool.prefault)
        self.ns: str | None = None
        self.copier: BlockCopier | None = None
        self.stats = HpkvConnectorStats()
        self._failed_blocks: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.v1.kv_cache_interface import group_kernel_blocks

        num_blocks = self.kv_cache_config.num_blocks
        views = []
        for name, page in zip(self.layout.layer_names, self.layout.page_bytes):
            ref = group_kernel_blocks(kv_caches[name], num_blocks)
            elem = ref.element_size()
            views.append(torch.tensor([], dtype=torch.int8, device=ref.device).set_(
                ref.untyped_storage(), ref.storage_offset() * elem, (num_blocks, page), (ref.stride(0) * elem, 1)))
        self.copier = BlockCopier(views, self.layout.layer_offsets)
        self._connect()
        log.info("HPKV worker rank %d: %d layers, %d bytes per block entry, namespace %s", self.rank,
                 len(views), self.layout.entry_bytes, self.ns)

    def _connect(self) -> bool:
        try:
            self.ns = self.client.register(self.desc)
            return True
        except HpkvError as exc:
            log.warning("HPKV server unavailable for worker rank %d: %s", self.rank, exc)
            self.stats.add("server_errors", 1)
            return False

    # -- loads --------------------------------------------------------------------------------

    def start_load_kv(self, meta: HpkvConnectorMetadata) -> None:
        for job in meta.loads:
            started = time.perf_counter()
            num_loaded = self._load(job)
            if num_loaded < len(job.block_ids):
                self._failed_blocks.update(job.block_ids[num_loaded:])
                self.stats.add("load_failures", len(job.block_ids) - num_loaded)
            self.stats.add("load_time_s", time.perf_counter() - started)
            self.stats.add("loaded_blocks", num_loaded)
            self.stats.add("loaded_bytes", num_loaded * self.layout.entry_bytes)

    def _load(self, job) -> int:
        """Copy the leading entries that are still there; returns how many blocks were loaded."""
        try:
            if self.ns is None and not self._connect():
                return 0
            started = leased = ready = copied = time.perf_counter()
            num_ready = 0
            lease = self.client.lease(self.ns, job.keys)
            try:
                leased = time.perf_counter()
                deadline = time.monotonic() + LOAD_WAIT_S
                num_ready = self.client.wait(lease, timeout_s=LOAD_WAIT_S)
                while num_ready is None and time.monotonic() < deadline:
                    num_ready = self.client.wait(lease, timeout_s=LOAD_WAIT_S)
                num_ready = min(num_ready or 0, len(job.block_ids))
                ready = time.perf_counter()
                if num_ready:
                    self.copier.load(lease.region, job.block_ids[:num_ready], lease.offsets[:num_ready])
                copied = time.perf_counter()
                # Only bytes copied while our lease pinned them can be trusted.
                return num_ready if self.client.holds(lease) else 0
            finally:
                self.client.release(lease)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("request %s: lease %.1f ms, wait %.1f ms, copy of %d blocks %.1f ms, release %.1f ms",
                              job.req_id, (leased - started) * 1e3, (ready - leased) * 1e3, num_ready,
                              (copied - ready) * 1e3, (time.perf_counter() - copied) * 1e3)
        except HpkvError as exc:
            self.stats.add("server_errors", 1)
            log.warning("HPKV load failed; vLLM recomputes those blocks: %s", exc)
            return 0

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- saves --------------------------------------------------------------------------------

    def wait_for_save(self, meta: HpkvConnectorMetadata) -> None:
        keys, block_ids = [], []
        for job in meta.saves:
            keys.extend(job.keys)
            block_ids.extend(job.block_ids)
        if not keys or self.copier is None:
            return
        started = time.perf_counter()
        try:
            if self.ns is None and not self._connect():
                return
            reservation = self.client.reserve(self.ns, keys)
            held = [i for i, offset in enumerate(reservation.offsets) if offset is not None]
            if held:
                self.copier.save(reservation.region, [block_ids[i] for i in held],
                                 [reservation.offsets[i] for i in held])
                self.client.commit(self.ns, [keys[i] for i in held])
        except HpkvError as exc:
            self.stats.add("server_errors", 1)
            log.debug("HPKV save skipped: %s", exc)
            return
        self.stats.add("save_time_s", time.perf_counter() - started)
        self.stats.add("saved_blocks", len(held))
        self.stats.add("saved_bytes", len(held) * self.layout.entry_bytes)

    def take_stats(self) -> HpkvConnectorStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, HpkvConnectorStats()
        return stats

    def shutdown(self) -> None:
        self.client.close()
