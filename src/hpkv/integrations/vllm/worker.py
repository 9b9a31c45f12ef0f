"""The worker half of HpkvConnectorV1: moves bytes between this rank's paged KV and the pool.

It decides nothing: the scheduler half says which blocks to load and which to save, with their
keys. Loads run in `start_load_kv`, before the forward pass that needs them, all of a step's under
one batched lease of the worker's own (released by a thread of its own). Saves start in
`wait_for_save`, after the forward pass: the worker reserves slots for all of the step's groups at
once, then (asynchronous saves) hands the copy and the commit to a saver thread,
on an accelerator on a stream of its own after an event at the end of the forward pass, so the
next step runs meanwhile; with synchronous saves (the default on the CPU, or
`"hpkv.async_save": false`) both happen inside `wait_for_save`. A block being copied must not be
overwritten: vLLM writes only into blocks it allocated for the step, which the metadata lists, so
`fence` (from `handle_preemptions`) waits for the saves that still read any of them.
A save that cannot happen (server gone, pool full) is skipped: a future miss, never an error; a
load that cannot happen is reported as failed blocks, which vLLM recomputes (a hybrid model's,
asynchronous to vLLM, as a failed request: `take_recving`). Each KV cache group has its
namespace and copier; the namespaces are named by the model's identity, which the scheduler
computes and sends in its metadata once known (the workers read no weight file for it).
Must not know: what to load or save (the scheduler half), the store.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ...config import Settings
from ...errors import HpkvError
from ...identity import ModelIdentity
from ...keys import NamespaceDesc
from ...server.client import Client, LeaseHandle, Reservation
from ...transfer.blocks import BlockCopier
from . import layout as lay
from .connectorstats import HpkvConnectorStats
from .metadata import HpkvConnectorMetadata, LoadJob
from .pending import HpkvWorkerMeta
from .savequeue import SaveQueue
from .views import block_rows, saves_overlap

log = logging.getLogger("hpkv.vllm.worker")

LOAD_WAIT_S = 10.0  # promotions the scheduler saw done; only a server restart makes this wait
SAVER_JOIN_S = 30.0  # at shutdown, for the saves in flight


@dataclass
class _SavePart:
    """One KV cache group's blocks of a step's saves, with the slots reserved for them."""

    group: int
    keys: list[bytes]
    block_ids: list[int]
    offsets: list[int]


@dataclass
class _Save:
    """One step's saves (every group's, in one reservation), waiting to be copied and committed."""

    reservation: Reservation
    parts: list[_SavePart]
    block_ids: list[int]  # every part's: the blocks the save reads (`SaveQueue.fence`)
    event: object | None = None  # accelerators: recorded when the forward pass wrote the blocks
    hold: str = ""  # the hold they were reserved in (the scheduler commits them), or ""


class HpkvWorker:
    def __init__(
        self, vllm_config, kv_cache_config, settings: Settings, rank: int, async_saves: bool | None = None
    ) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.rank = rank
        self.layouts = lay.group_layouts(vllm_config, kv_cache_config)
        self.descs: list[NamespaceDesc] = []  # once the scheduler's metadata names the model (_connect)
        self.client = Client(
            settings.pool.dir,
            kind=f"vllm-worker-{rank}",
            prefault=settings.pool.prefault,
            trusted_uids=settings.server_allow_uids,
        )
        self.nss: list[str] | None = None  # one per KV cache group, once registered
        self.copiers: list[BlockCopier] = []
        self.stats = HpkvConnectorStats()
        self._failed_blocks: set[int] = set()
        self._recving: tuple[set[str], set[str]] = (set(), set())  # asynchronous loads: done, failed
        self._failed_holds: set[int] = set()  # steps whose held saves were not all copied here
        # The metadata built for the step running now, when it was built before its saves ran
        # (vLLM with speculative decoding finalizes saves after building it): failures go there.
        self._meta_out: tuple[int, HpkvWorkerMeta] | None = None
        self.async_saves = async_saves  # None: decided in register_kv_caches, by device
        self._stats_lock = threading.Lock()
        self.saves: SaveQueue[_Save] = SaveQueue(self._save)
        self._side_stream: Any = None  # a Stream of the device's torch module (torch.cuda, torch.npu...)
        self._releaser: ThreadPoolExecutor | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.v1.kv_cache_interface import group_kernel_blocks

        num_blocks = self.kv_cache_config.num_blocks
        kv_layout = getattr(self.vllm_config.cache_config, "kv_cache_layout", None)
        for layout in self.layouts:
            views = [
                block_rows(name, group_kernel_blocks(kv_caches[name], num_blocks), num_blocks, page, kv_layout)
                for name, page in zip(layout.layer_names, layout.page_bytes)
            ]
            self.copiers.append(BlockCopier(views, layout.layer_offsets))
        self.async_saves = saves_overlap(
            self.async_saves, self.copiers[0].device.type, self.vllm_config, self.layouts[0], self.kv_cache_config
        )
        try:  # the server reached (or started) now, not at the first request
            self.client.connect()
        except HpkvError as exc:
            log.warning("HPKV server unavailable for worker rank %d: %s", self.rank, exc)
            self._add("server_errors", 1)
        log.info(
            "HPKV worker rank %d: %s layers, %s bytes per block entry, %s saves",
            self.rank,
            "+".join(str(len(layout.layer_names)) for layout in self.layouts),
            "+".join(str(layout.entry_bytes) for layout in self.layouts),
            "asynchronous" if self.async_saves else "synchronous",
        )

    def _add(self, name: str, value: float) -> None:
        with self._stats_lock:
            self.stats.add(name, value)

    def _connect(self, identity: ModelIdentity | None = None) -> list[str] | None:
        """Register this rank's namespaces (one per KV cache group), named by the model's identity,
        which the scheduler's metadata carries once it knows it (no load or save comes before);
        None while the server is unavailable or the identity is not known."""
        if not self.descs and identity is not None:
            self.descs = [lay.namespace(self.vllm_config, layout, self.rank, identity) for layout in self.layouts]
            log.info("HPKV worker rank %d: namespace model %s", self.rank, self.descs[0].model)
        if not self.descs:
            return None
        try:
            self.nss = [self.client.register(desc) for desc in self.descs]
            return self.nss
        except HpkvError as exc:
            log.warning("HPKV server unavailable for worker rank %d: %s", self.rank, exc)
            self._add("server_errors", 1)
            return None

    # -- loads --------------------------------------------------------------------------------

    def start_load_kv(self, meta: HpkvConnectorMetadata) -> None:
        """Every load of the step under one batched lease (one `Lease`, one `Release`)."""
        if self.nss is None:
            self._connect(meta.identity)
        if not meta.loads:
            return
        started = time.perf_counter()
        loaded = self._load(meta.loads)
        for job, num_loaded in zip(meta.loads, loaded):
            # An asynchronous job with no keys is one the scheduler could not plan: failed, whole.
            if num_loaded < len(job.block_ids) or job.notify and not job.keys:
                if job.notify:  # vLLM recomputes the whole request: every group's loads with it
                    self._recving[1].add(job.req_id)
                else:
                    self._failed_blocks.update(job.block_ids[num_loaded:])
                self._add("load_failures", len(job.block_ids) - num_loaded)
            if job.notify:
                self._recving[0].add(job.req_id)
            self._add("loaded_blocks", num_loaded)
            self._add("loaded_bytes", num_loaded * self.layouts[job.group].entry_bytes)
        self._add("load_time_s", time.perf_counter() - started)

    def _load(self, jobs: list[LoadJob]) -> list[int]:
        """Copy each job's leading entries that are still there, all under one batched lease of
        this rank's own (its bytes pinned for exactly as long as it reads them, whatever happens
        to the scheduler's connection); how many blocks of each job were loaded."""
        loaded = [0] * len(jobs)
        try:
            nss = self.nss if self.nss is not None else self._connect()
            todo = [i for i, job in enumerate(jobs) if job.keys and nss is not None]
            if nss is None or not todo:
                return loaded
            started = time.perf_counter()
            leases = self.client.lease_many([(nss[jobs[i].group], jobs[i].keys) for i in todo])
            try:
                leased = time.perf_counter()
                deadline = time.monotonic() + LOAD_WAIT_S
                counts = self.client.wait_all(leases, timeout_s=LOAD_WAIT_S)
                while None in counts and time.monotonic() < deadline:
                    counts = self.client.wait_all(leases, timeout_s=max(0.0, deadline - time.monotonic()))
                ready = time.perf_counter()
                for i, lease, count in zip(todo, leases, counts):
                    num_ready = min(count or 0, len(jobs[i].block_ids))
                    if num_ready:  # vLLM registers its KV caches before any load
                        self.copiers[jobs[i].group].load(
                            lease.region, jobs[i].block_ids[:num_ready], lease.offsets[:num_ready]
                        )
                    loaded[i] = num_ready
                # Only bytes copied while our leases pinned them can be trusted.
                if not all(self.client.alive(lease) for lease in leases):
                    loaded = [0] * len(jobs)
                copied = (time.perf_counter() - ready) * 1e3
                log.debug(
                    "lease %.1f ms, wait %.1f ms, copy %.1f ms",
                    (leased - started) * 1e3,
                    (ready - leased) * 1e3,
                    copied,
                )
            finally:
                self._release_later(leases)
        except HpkvError as exc:
            self._add("server_errors", 1)
            log.warning("HPKV load failed; vLLM recomputes those blocks: %s", exc)
            return [0] * len(jobs)
        except Exception:  # never let a load take the engine down: the blocks are recomputed
            self._add("server_errors", 1)
            log.exception("HPKV load failed; vLLM recomputes those blocks")
            return [0] * len(jobs)
        return loaded

    def _release_later(self, leases: list[LeaseHandle]) -> None:
        """The copy is over (or never started): the release's round trip runs on a thread of its
        own, not before the forward pass. Nothing waits for it: the server unpins the entries when
        it arrives, or when the connection closes."""
        if self._releaser is None:
            self._releaser = ThreadPoolExecutor(1, thread_name_prefix="hpkv-release")
        self._releaser.submit(self._release, leases)

    def _release(self, leases: list[LeaseHandle]) -> None:
        try:
            self.client.release(*leases)
        except HpkvError as exc:  # the connection is gone, and the leases with it
            log.debug("HPKV lease release skipped: %s", exc)

    def worker_meta(self, seq: int) -> HpkvWorkerMeta:
        """What this step tells the scheduler: its number, and the held steps not copied in full
        (this one's too, should its saves fail after this is built: it is not sent before)."""
        meta = HpkvWorkerMeta({seq}, self._failed_holds)
        self._failed_holds = set()
        self._meta_out = (seq, meta)
        return meta

    def _hold_failed(self, seq: int) -> None:
        out = self._meta_out
        if out is not None and out[0] == seq:
            out[1].failed.add(seq)
        else:
            self._failed_holds.add(seq)

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_recving(self) -> tuple[set[str], set[str]]:
        """The requests whose asynchronous loads ended since the last call, and those that failed."""
        recving, self._recving = self._recving, (set(), set())
        return recving

    # -- saves --------------------------------------------------------------------------------

    def wait_for_save(self, meta: HpkvConnectorMetadata) -> None:
        """Every save of the step in one reservation over its groups (one `Reserve`, and one
        `Commit` unless a hold settles it)."""
        if self.nss is None:
            self._connect(meta.identity)
        by_group: dict[int, tuple[list[bytes], list[int]]] = {}
        for job in meta.saves:
            keys, block_ids = by_group.setdefault(job.group, ([], []))
            keys.extend(job.keys)
            block_ids.extend(job.block_ids)
        groups = [(group, keys, block_ids) for group, (keys, block_ids) in sorted(by_group.items()) if keys]
        if not self.copiers or not groups:
            return
        started = time.perf_counter()
        self._save_step(meta, groups)
        self._add("save_wait_s", time.perf_counter() - started)

    def _save_step(self, meta: HpkvConnectorMetadata, groups: list[tuple[int, list[bytes], list[int]]]) -> None:
        try:
            nss = self.nss if self.nss is not None else self._connect()
            if nss is None:
                return
            reservation = self.client.reserve_many([(nss[group], keys) for group, keys, _ in groups], hold=meta.hold)
        except HpkvError as exc:
            self._add("server_errors", 1)
            log.debug("HPKV save skipped: %s", exc)
            if meta.hold:  # it may have been made on the server all the same, and nothing copied
                self._hold_failed(meta.seq)
            return
        parts = []
        for (group, keys, block_ids), offsets in zip(groups, reservation.part_offsets):
            taken = [i for i, offset in enumerate(offsets) if offset is not None]
            if taken:
                parts.append(
                    _SavePart(
                        group,
                        [keys[i] for i in taken],
                        [block_ids[i] for i in taken],
                        [offsets[i] for i in taken],  # type: ignore[misc]
                    )
                )
        if not parts:
            return
        save = _Save(reservation, parts, [block for part in parts for block in part.block_ids])
        if meta.hold:
            # The scheduler settles the hold once this step's output is back, so the copy must
            # be done by then: in this step, not beside the next one. Not committed here.
            save.hold = meta.hold
            if not self._save(save):
                self._hold_failed(meta.seq)
        elif self.async_saves:
            save.event = self._forward_done_event()
            self.saves.put(save)
        else:
            self._save(save)

    def _save(self, save: _Save) -> bool:
        """Copy the blocks into their reserved slots and publish them (or leave that to the
        hold they were reserved in). A copy that fails gives the slots back, held or not, and
        returns False: a hold must not commit bytes that were never copied."""
        started = time.perf_counter()
        try:
            if not self.client.alive(save.reservation):
                return False  # the connection that reserved the slots is gone, and the slots with it
            for part in save.parts:
                self._copy(save, part)
            if not save.hold:
                self.client.commit(save.reservation)
        except HpkvError as exc:
            self._add("server_errors", 1)
            log.debug("HPKV save skipped: %s", exc)
            self._give_back(save)
            return False
        except Exception:  # never let a save take the engine (or the saver thread) down
            self._add("server_errors", 1)
            log.exception("HPKV save failed; those blocks will be recomputed when needed")
            self._give_back(save)
            return False
        self._add("save_time_s", time.perf_counter() - started)
        for part in save.parts:
            self._add("saved_blocks", len(part.keys))
            self._add("saved_bytes", len(part.keys) * self.layouts[part.group].entry_bytes)
        return True

    def _copy(self, save: _Save, part: _SavePart) -> None:
        copier = self.copiers[part.group]
        if save.event is None:
            copier.save(save.reservation.region, part.block_ids, part.offsets)
            return
        device_mod = getattr(torch, copier.device.type)
        if self._side_stream is None:
            self._side_stream = device_mod.Stream(copier.device)
        with device_mod.stream(self._side_stream):
            self._side_stream.wait_event(save.event)
            copier.save(save.reservation.region, part.block_ids, part.offsets)

    def _give_back(self, save: _Save) -> None:
        try:  # the reservation's own connection, or nothing: never what a newer one reserved
            self.client.abort(save.reservation)
        except HpkvError:
            pass  # the connection is gone, and the reservation with it

    def _forward_done_event(self):
        """An event on the engine's current stream, after the forward pass's writes (None on
        the CPU, where the forward pass is done when wait_for_save runs)."""
        device = self.copiers[0].device
        if device.type == "cpu":
            return None
        device_mod = getattr(torch, device.type)
        event = device_mod.Event()
        event.record(device_mod.current_stream(device))
        return event

    def fence(self, block_ids: list[int]) -> None:
        """Return once no queued save still reads any of `block_ids` (blocks this step writes)."""
        waited = self.saves.fence(block_ids)
        if waited is not None:
            self._add("save_fences", 1)
            self._add("save_wait_s", waited)

    def take_stats(self) -> HpkvConnectorStats | None:
        with self._stats_lock:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, HpkvConnectorStats()
        return stats

    def shutdown(self) -> None:
        self.saves.close(SAVER_JOIN_S)
        if self._releaser is not None:
            self._releaser.shutdown(wait=True)
        self.client.close()
