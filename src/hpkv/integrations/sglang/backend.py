"""HpkvStorage: the L3 storage backend of SGLang's hierarchical cache, kept in HPKV.

SGLang builds it through its `dynamic` storage backend with the zero-copy v1 interface (see
`flag.py`), one per scheduler process (TP/PP rank), as `HpkvStorage(storage_config, {})`, then
hands it the host pool (`register_mem_pool_host`). Pages go to and from the node's HPKV server:
its shared-memory DRAM pool (shared with every other engine on the node, vLLM included) and its
storage tier, which outlives restarts.

What SGLang calls, from which thread:
- `batch_exists(keys)` (prefetch thread): how many leading pages HPKV has, DRAM or storage.
- `batch_get_v1(keys, host_indices)` (prefetch I/O thread): lease the pages (storage hits are
  read into DRAM first), copy them into the host pages, release. Per key: loaded or not; only
  bytes copied while the lease still held are reported loaded.
- `batch_set_v1(keys, host_indices)` (backup thread): reserve, copy, commit. A page HPKV
  already holds, or has no room for, is skipped and reported stored: a future miss at worst.
  Pages that could never hit are not stored at all, only reported stored (`stores_pages`).
- `clear()` (scheduler, `POST /hicache/storage-backend/clear`): this namespace only, DRAM and
  storage, by the ranks that write it; the scheduler waits CLEAR_WAIT_S at most. `get_stats()`,
  `close()`.

Every thread has its own HPKV client, so a timeout in one never closes another's connection in
the middle of a copy. HPKV faults (no server, a server killed or restarted, timeouts) are
misses: `batch_exists` 0, `batch_get_v1`/`batch_set_v1` False; nothing raises into SGLang's
threads, and SGLang recomputes. A bad configuration fails at start instead, with the fix.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult

from ...config import load_settings
from ...errors import ConfigError, HpkvError
from ...identity import override_identity
from ...keys import NamespaceDesc
from ...logutil import Throttle
from ...server.autostart import ServerUnavailable
from ...server.client import Client
from . import layout as lay
from . import pages as pg
from .flag import backend_config
from .stats import BackendStats

log = logging.getLogger("hpkv.sglang")

PROMOTION_WAIT_S = 10.0  # storage hits being read into DRAM; SGLang's own prefetch timeout runs too
FAULT_LOG_INTERVAL_S = 30.0
CLEAR_WAIT_S = 5.0  # the scheduler thread serves every request: a longer clear goes on in the background


class HpkvStorage(HiCacheStorage):
    def __init__(self, storage_config, kwargs: dict | None = None) -> None:
        extra = storage_config.extra_config or {}
        if not extra.get("interface_v1"):
            raise ConfigError(
                "HPKV's SGLang backend needs the zero-copy v1 interface: add \"interface_v1\": 1 to "
                f"--hicache-storage-backend-extra-config (or use --enable-ct-hpkv), e.g. {backend_config(1204)}")
        self.storage_config = storage_config
        settings = load_settings()
        if getattr(storage_config, "tp_rank", 0) == 0:
            for warning in settings.warnings:  # a mistyped key, a config file that is not there
                log.warning("%s", warning)
        pool = settings.pool
        self.pool_dir, self.prefault = pool.dir, pool.prefault
        self.trusted_uids = settings.server_allow_uids
        self.model_override = settings.model_id
        self.layout: lay.PageLayout | None = None
        self.desc: NamespaceDesc | None = None
        self.ns: str | None = None
        self.stats = BackendStats(storage_config.enable_storage_metrics)
        self._local = threading.local()
        self._clients: dict[threading.Thread, Client] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._fault_log = Throttle()  # by kind: HPKV faults (False), unexpected errors (True)
        self.stores_pages = True  # False where no page stored could ever be a hit (see _store_nothing)
        self._pools_registered = False

    # -- registration -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.layout = layout = lay.page_layout(mem_pool_host)
        model = lay.model_id(self.model_override)
        if model is None and self.model_override:
            model = lay.ModelId(override_identity(self.model_override).id, "auto", "HPKV_MODEL_ID")
        if model is None and self.storage_config.tp_rank == 0:
            log.warning("SGLang's server arguments are not published in this process, so HPKV names the model by "
                        "its served name %r only: give every model (and every fine-tune, quantization or KV dtype "
                        "of it) its own --served-model-name, or set HPKV_MODEL_ID, or HPKV may load another "
                        "model's KV", self.storage_config.model_name)
        self.desc = desc = lay.namespace(self.storage_config, layout, model)
        self.ns = desc.ns
        if model is not None and model.identity is not None and self.storage_config.tp_rank == 0:
            log.info("HPKV model identity: %s; model %s; namespace model %s", model.identity.describe(),
                     model.model_path, desc.model)
        log.info("HPKV storage for SGLang: namespace %s (%s), %d bytes per page, pool %s", self.ns,
                 desc.to_json(), layout.entry_bytes, self.pool_dir)
        config = self.storage_config
        if layout.layer_sharded and config.is_mla_model and config.tp_size > 1:
            # Each TP rank holds other layers, so each has its own namespace; but SGLang treats
            # MLA KV as rank-replicated and lets only rank 0 back it up: the other ranks never
            # hit, and the hit every rank agrees on is theirs.
            self._store_nothing()
            if config.tp_rank == 0:
                log.warning("HPKV cannot serve MLA KV whose layers are split over the TP ranks: SGLang saves only "
                            "TP rank 0's layers, so no rank ever has a whole page. HPKV stores nothing for this "
                            "engine; run it without layer sharding to use HPKV")

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(host_pool_name) != "kv":
            # With side pools SGLang asks only batch_exists_v2, which finds nothing (side pools
            # are not stored): a KV page stored would never hit, only evict other engines' pages.
            self._store_nothing()
            if self._pools_registered:  # a sidecar added after start-up
                self.on_host_pools_registered()

    def on_host_pools_registered(self) -> None:
        self._pools_registered = True
        side = [name for name in getattr(self, "registered_pools", {}) if str(name) != "kv"]
        if side:
            log.warning("HPKV stores the KV pool only; this model's side pools %s are not stored, so SGLang finds "
                        "no L3 hits for it and HPKV stores none of its pages", [str(name) for name in side])

    def _store_nothing(self) -> None:
        """Report every page stored without storing it: SGLang then neither retries nor keeps the
        pages back, and HPKV's pool keeps its room for pages that can hit."""
        self.stores_pages = False

    # -- the v1 interface ---------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        if not keys:
            return 0
        return self._guard("exists", 0, self._exists, keys)

    def batch_get_v1(self, keys: list[str], host_indices, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        return self._guard("load", [False] * len(keys), self._load, keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        if not self.stores_pages:
            return [True] * len(keys)
        return self._guard("save", [False] * len(keys), self._save, keys, host_indices)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _exists(self, keys: list[str]) -> int:
        ns, _ = self._registered()
        client = self._client()
        hit = client.lookup(ns, lay.page_keys(keys))
        self.stats.looked_up(len(keys), hit.num_dram, hit.num_storage)
        return hit.num_hit

    def _load(self, keys: list[str], host_indices) -> list[bool]:
        started = time.perf_counter()
        ns, layout = self._registered()
        host_pages = pg.PageBuffers.of(self.mem_pool_host, host_indices, len(keys), layout)
        client = self._client()
        lease = client.lease(ns, lay.page_keys(keys))
        try:
            num = min(self._wait(client, lease), len(keys))
            if num:
                pg.load(lease.region, lease.offsets[:num], host_pages)
            if not client.holds(lease):  # the server let the slots go mid-copy: the bytes are void
                num = 0
        finally:
            self._release(client, lease)
        self.stats.loaded(num, len(keys) - num, num * layout.entry_bytes, time.perf_counter() - started)
        return [i < num for i in range(len(keys))]

    def _wait(self, client: Client, lease) -> int:
        deadline = time.monotonic() + PROMOTION_WAIT_S
        num_ready = client.wait(lease, timeout_s=PROMOTION_WAIT_S)
        while num_ready is None and time.monotonic() < deadline:
            num_ready = client.wait(lease, timeout_s=max(0.0, deadline - time.monotonic()))
        return num_ready or 0

    def _abort(self, client: Client, keys, reservation) -> None:
        try:  # the reservation's own connection, or nothing: never what a newer one reserved
            client.abort(self._registered()[0], keys, reservation=reservation)
        except HpkvError:
            pass  # a vanished server's reservations vanish with it

    @staticmethod
    def _release(client: Client, lease) -> None:
        try:
            client.release(lease)
        except HpkvError:
            pass  # a vanished server's leases vanish with it

    def _save(self, keys: list[str], host_indices) -> list[bool]:
        started = time.perf_counter()
        ns, layout = self._registered()
        host_pages = pg.PageBuffers.of(self.mem_pool_host, host_indices, len(keys), layout)
        entry_keys = lay.page_keys(keys)
        client = self._client()
        reservation = client.reserve(ns, entry_keys)
        offsets = {i: offset for i, offset in enumerate(reservation.offsets) if offset is not None}
        held = list(offsets)
        if held:
            held_keys = [entry_keys[i] for i in held]
            try:
                pg.save(reservation.region, list(offsets.values()), host_pages, held)
                if not client.holds(reservation):  # reclaimed with the connection: nothing was stored
                    return [False] * len(keys)
                client.commit(ns, held_keys, reservation=reservation)
            except BaseException:
                self._abort(client, held_keys, reservation)
                raise
        self.stats.saved(len(held), len(keys) - len(held), len(held) * layout.entry_bytes,
                         time.perf_counter() - started)
        return [True] * len(keys)

    # -- the legacy copying interface: not used (v1 is required), so every call is a miss -----

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        return None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return False

    # -- the v2 (hybrid models) interface: side pools are not stored, so every call is a miss --

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        return {transfer.name: [False] * len(transfer.keys or ()) for transfer in transfers}

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        return {transfer.name: [False] * len(transfer.keys or ()) for transfer in transfers}

    # -- administration -----------------------------------------------------------------------

    def clear(self) -> None:
        """Remove this namespace's pages from HPKV, DRAM and storage; other namespaces stay.

        SGLang calls it on every rank's scheduler thread, between requests. Only a rank that
        writes the namespace clears it (with MLA every TP rank reads rank 0's). The clear runs
        in a thread of its own (starting a server, if need be, to reach the storage tier);
        the scheduler waits for it CLEAR_WAIT_S at most, then leaves it to finish."""
        if self.ns is None or self._closed or not self.storage_config.is_storage_writer:
            return
        worker = threading.Thread(target=self._guard, args=("clear", None, self._clear), name="hpkv-clear",
                                  daemon=True)
        worker.start()
        worker.join(CLEAR_WAIT_S)
        if worker.is_alive():
            log.warning("HPKV is still clearing namespace %s after %.0f s; it goes on in the background",
                        self.ns, CLEAR_WAIT_S)

    def _clear(self) -> None:
        # Not prefaulted: a clear that comes before any storage thread has mapped the pool must
        # not populate all of it for one message.
        with Client(self.pool_dir, kind="sglang-clear", prefault=False, trusted_uids=self.trusted_uids) as client:
            client.clear(memory=True, storage=True, ns=self.ns)

    def get_stats(self):
        """SGLang's StorageMetrics since the last call; None unless SGLang's metrics are on."""
        return self.stats.take_storage_metrics()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    # -- clients and faults -------------------------------------------------------------------

    def _registered(self) -> tuple[str, lay.PageLayout]:
        """This rank's namespace and page layout (SGLang calls register_mem_pool_host before any I/O)."""
        assert self.ns is not None and self.layout is not None, "register_mem_pool_host comes first"
        return self.ns, self.layout

    def _client(self) -> Client:
        """This thread's client, registered in this rank's namespace."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._new_client()
            self._local.client = client
            self._local.registered = False
        if not self._local.registered:
            assert self.desc is not None  # register_mem_pool_host comes before any I/O
            client.register(self.desc)
            self._local.registered = True
        return client

    def _new_client(self) -> Client:
        """A client for this thread. SGLang restarts its storage threads (on /flush_cache, for
        one), so the clients of threads that ended are closed here."""
        this = threading.current_thread()
        client = Client(self.pool_dir, kind=f"sglang-{this.name}", prefault=self.prefault,
                        trusted_uids=self.trusted_uids)
        with self._lock:
            if self._closed:
                raise ServerUnavailable("the HPKV storage backend is closed")
            ended = [thread for thread in self._clients if not thread.is_alive()]
            for thread in ended:
                self._clients.pop(thread).close()
            self._clients[this] = client
        return client

    def _guard(self, what: str, miss, fn, *args):
        """SGLang's threads get a miss, never an exception."""
        if self._closed or self.ns is None:
            return miss
        try:
            return fn(*args)
        except HpkvError as exc:
            self._fault(what, exc, unexpected=False)
        except Exception as exc:
            self._fault(what, exc, unexpected=True)
        return miss

    def _fault(self, what: str, exc: Exception, unexpected: bool) -> None:
        """One record per FAULT_LOG_INTERVAL_S for each kind (HPKV faults; bugs, with their
        traceback), the rest at debug: a fault repeats on every call of three threads."""
        self.stats.fault()
        if not self._fault_log.allows(time.monotonic(), FAULT_LOG_INTERVAL_S, unexpected):
            log.debug("HPKV %s failed: %s", what, exc, exc_info=unexpected)
            return
        if unexpected:
            log.error("HPKV %s failed unexpectedly, SGLang recomputes (next %.0f s of such failures logged at "
                      "debug)", what, FAULT_LOG_INTERVAL_S, exc_info=exc)
        else:
            log.warning("HPKV %s failed, SGLang recomputes (next %.0f s of such faults logged at debug): %s",
                        what, FAULT_LOG_INTERVAL_S, exc)
