"""HpkvStorage: the L3 storage backend of SGLang's hierarchical cache, kept in HPKV.

SGLang builds it through its `dynamic` storage backend with the zero-copy v1 interface (see
`flag.py`), one per scheduler process (TP/PP rank), then hands it the host pool
(`register_mem_pool_host`, where SGLang's page hash is made ready (`warmup`) and the model's
identity is read on a thread of its own; once it is known the namespace is bound and HPKV's server
reached, or started, in the background; until then every lookup is a miss and nothing is stored). Owns SGLang's
interface: the namespace of this rank, which pages are worth storing (`stores_pages`: none where
no page could ever hit), and `clear` (this namespace, by the ranks that write it, waiting
CLEAR_WAIT_S at most on the scheduler thread). The transfers, a client per SGLang thread and the
faults-as-misses are `pageio.PageIO`'s: nothing raises into SGLang's threads, SGLang recomputes.
A bad configuration fails at start. Knows nothing of the server's store.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult

from ...config import load_settings
from ...errors import ConfigError
from ...identity import IdentityTask, ModelIdentity, override_identity
from ...keys import NamespaceDesc
from . import layout as lay
from . import modelid, warmup
from .flag import backend_config
from .pageio import PageIO
from .stats import BackendStats

log = logging.getLogger("hpkv.sglang")

CLEAR_WAIT_S = 5.0  # the scheduler thread serves every request: a longer clear goes on in the background


class HpkvStorage(HiCacheStorage):
    def __init__(self, storage_config, kwargs: dict | None = None) -> None:
        extra = storage_config.extra_config or {}
        if not extra.get("interface_v1"):
            raise ConfigError(
                'HPKV\'s SGLang backend needs the zero-copy v1 interface: add "interface_v1": 1 to '
                f"--hicache-storage-backend-extra-config (or use --enable-ct-hpkv), e.g. {backend_config(1204)}"
            )
        self.storage_config = storage_config
        settings = load_settings()
        if getattr(storage_config, "tp_rank", 0) == 0:
            for warning in settings.warnings:  # a mistyped key, a config file that is not there
                log.warning("%s", warning)
        pool = settings.pool
        self.pool_dir = pool.dir
        self.model_override = settings.model_id
        self.layout: lay.PageLayout | None = None
        self.desc: NamespaceDesc | None = None  # once the model's identity is known (_bind)
        self.identity: IdentityTask | None = None
        self.ns: str | None = None
        self.stats = BackendStats(storage_config.enable_storage_metrics)
        self.io = PageIO(pool.dir, pool.prefault, settings.server_allow_uids, self.stats)
        self.stores_pages = True  # False where no page stored could ever be a hit (see _store_nothing)
        self._pools_registered = False

    # -- registration -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.layout = layout = lay.page_layout(mem_pool_host)
        warmup.ready_page_hash(mem_pool_host.page_size)  # SGLang's first lookup must not build its page hash
        # The model's identity reads every byte of files not seen before: on a thread of its own.
        # Until it is known the namespace is unbound: every lookup a miss, nothing stored (PageIO.run).
        self.identity = IdentityTask(lambda: self._bind(layout), f"sglang-{modelid.launch_scope()}")
        self.identity.wait(modelid.START_WAIT_S)  # remembered (or small): serve with HPKV from the start
        config = self.storage_config
        if layout.layer_sharded and config.is_mla_model and config.tp_size > 1:
            # Each TP rank holds other layers, so each has its own namespace; but SGLang treats
            # MLA KV as rank-replicated and lets only rank 0 back it up: the other ranks never
            # hit, and the hit every rank agrees on is theirs.
            self._store_nothing()
            if config.tp_rank == 0:
                log.warning(
                    "HPKV cannot serve MLA KV whose layers are split over the TP ranks: SGLang saves only "
                    "TP rank 0's layers, so no rank ever has a whole page. HPKV stores nothing for this "
                    "engine; run it without layer sharding to use HPKV"
                )

    def _bind(self, layout: lay.PageLayout) -> ModelIdentity:
        """This rank's namespace, from the model's identity; returns the identity."""
        model = lay.model_id(self.model_override)
        if model is None and self.model_override:
            model = lay.ModelId(override_identity(self.model_override).id, "auto", "HPKV_MODEL_ID")
        if model is None and self.storage_config.tp_rank == 0:
            log.warning(
                "SGLang's server arguments are not published in this process, so HPKV names the model by "
                "its served name %r only: give every model (and every fine-tune, quantization or KV dtype "
                "of it) its own --served-model-name, or set HPKV_MODEL_ID, or HPKV may load another "
                "model's KV",
                self.storage_config.model_name,
            )
        self.desc = desc = lay.namespace(self.storage_config, layout, model)
        self.ns = desc.ns
        self.io.bind(desc, layout)
        self.io.connect_early()  # SGLang's next lookup must find a server, not start one
        if model is not None and model.identity is not None and self.storage_config.tp_rank == 0:
            log.info("HPKV model %s; namespace model %s", model.model_path, desc.model)
        log.info(
            "HPKV storage for SGLang: namespace %s (%s), %d bytes per page, pool %s",
            self.ns,
            desc.to_json(),
            layout.entry_bytes,
            self.pool_dir,
        )
        if model is not None and model.identity is not None:
            return model.identity
        return ModelIdentity(desc.model, "the served model name" if model is None else model.source)

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
            log.warning(
                "HPKV stores the KV pool only; this model's side pools %s are not stored, so SGLang finds "
                "no L3 hits for it and HPKV stores none of its pages",
                [str(name) for name in side],
            )

    def _store_nothing(self) -> None:
        """Report every page stored without storing it: SGLang then neither retries nor keeps the
        pages back, and HPKV's pool keeps its room for pages that can hit."""
        self.stores_pages = False

    # -- the v1 interface ---------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        if not keys:
            return 0
        return self.io.run("exists", 0, self.io.exists, keys)

    def batch_get_v1(self, keys: list[str], host_indices, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        return self.io.run("load", [False] * len(keys), self.io.load, self.mem_pool_host, keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        if not self.stores_pages:
            return [True] * len(keys)
        return self.io.run("save", [False] * len(keys), self.io.save, self.mem_pool_host, keys, host_indices)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the legacy copying interface: not used (v1 is required), so every call is a miss -----

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        return None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return False

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
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
        if self.ns is None or self.io.closed or not self.storage_config.is_storage_writer:
            return
        worker = threading.Thread(
            target=self.io.run, args=("clear", None, self.io.clear), name="hpkv-clear", daemon=True
        )
        worker.start()
        worker.join(CLEAR_WAIT_S)
        if worker.is_alive():
            log.warning(
                "HPKV is still clearing namespace %s after %.0f s; it goes on in the background", self.ns, CLEAR_WAIT_S
            )

    def get_stats(self):
        """SGLang's StorageMetrics since the last call; None unless SGLang's metrics are on."""
        return self.stats.take_storage_metrics()

    def close(self) -> None:
        self.io.close()
