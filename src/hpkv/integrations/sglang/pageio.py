"""The page I/O of one SGLang rank against the node's HPKV server, every fault a miss.

Owns a client per SGLang thread (so a timeout in one never closes another's connection in the
middle of a copy; the clients of threads that ended are closed), the first of them connected in
the background at registration (`connect_early`, starting the server if none answers, so that
SGLang's first lookup finds one ready within its prefetch timeout), and the three transfers:
`exists` (leading pages held, DRAM or storage), `load` (lease, wait for promotions, copy into
the host pages, release; only bytes copied while the lease held count), `save` (reserve, copy,
commit; a page held already or without room is skipped). `run` turns HPKV faults and bugs into
the caller's miss, logged at most once per FAULT_LOG_INTERVAL_S per kind.
Primitives: `Client`, `pages.load/save`. Knows nothing of SGLang's interface or configuration.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from ...errors import HpkvError
from ...keys import NamespaceDesc
from ...server.autostart import ServerUnavailable
from ...server.client import Client
from ...throttle import Throttle
from . import layout as lay
from . import pages as pg
from .stats import BackendStats

log = logging.getLogger("hpkv.sglang")

PROMOTION_WAIT_S = 10.0  # storage hits being read into DRAM; SGLang's own prefetch timeout runs too
FAULT_LOG_INTERVAL_S = 30.0


class PageIO:
    def __init__(self, pool_dir: Path, prefault: bool, trusted_uids: tuple[int, ...], stats: BackendStats) -> None:
        self.pool_dir, self.prefault, self.trusted_uids = pool_dir, prefault, trusted_uids
        self.stats = stats
        self.desc: NamespaceDesc | None = None
        self.layout: lay.PageLayout | None = None
        self.closed = False
        self._local = threading.local()
        self._clients: dict[threading.Thread, Client] = {}
        self._lock = threading.Lock()
        self._spare: Client | None = None  # connected early, for the first thread that asks
        self._fault_log = Throttle()  # by kind: HPKV faults (False), unexpected errors (True)

    def bind(self, desc: NamespaceDesc, layout: lay.PageLayout) -> None:
        """Until bound (the model's identity is known), every transfer is a miss (`run`)."""
        self.layout = layout  # first: other threads take a bound desc as a bound layout too
        self.desc = desc

    def connect_early(self) -> threading.Thread:
        """Connect and register one client in a thread of its own (a server start takes seconds:
        not on SGLang's scheduler thread), parked for the first SGLang thread that needs one."""
        worker = threading.Thread(target=self.run, args=("connect", None, self._park), name="hpkv-connect", daemon=True)
        worker.start()
        return worker

    def _park(self) -> None:
        assert self.desc is not None  # bound before
        client = Client(self.pool_dir, kind="sglang-early", prefault=self.prefault, trusted_uids=self.trusted_uids)
        try:
            client.connect()
            client.register(self.desc)
        except BaseException:
            client.close()
            raise
        with self._lock:
            parked = not self.closed and self._spare is None
            if parked:
                self._spare = client
        if not parked:
            client.close()

    def exists(self, keys: list[str]) -> int:
        ns, _ = self._registered()
        hit = self.client().lookup(ns, lay.page_keys(keys))
        self.stats.looked_up(len(keys), hit.num_dram, hit.num_storage)
        return hit.num_hit

    def load(self, host_pool, keys: list[str], host_indices) -> list[bool]:
        started = time.perf_counter()
        ns, layout = self._registered()
        host_pages = pg.PageBuffers.of(host_pool, host_indices, len(keys), layout)
        client = self.client()
        lease = client.lease(ns, lay.page_keys(keys))
        try:
            num = min(_wait(client, lease), len(keys))
            if num:
                pg.load(lease.region, lease.offsets[:num], host_pages)
            if not client.alive(lease):  # the server let the slots go mid-copy: the bytes are void
                num = 0
        finally:
            try:
                client.release(lease)
            except HpkvError:
                pass  # a vanished server's leases vanish with it
        self.stats.loaded(num, len(keys) - num, num * layout.entry_bytes, time.perf_counter() - started)
        return [i < num for i in range(len(keys))]

    def save(self, host_pool, keys: list[str], host_indices) -> list[bool]:
        started = time.perf_counter()
        ns, layout = self._registered()
        host_pages = pg.PageBuffers.of(host_pool, host_indices, len(keys), layout)
        entry_keys = lay.page_keys(keys)
        client = self.client()
        reservation = client.reserve(ns, entry_keys)
        offsets = {i: offset for i, offset in enumerate(reservation.offsets) if offset is not None}
        held = list(offsets)
        if held:
            try:
                pg.save(reservation.region, list(offsets.values()), host_pages, held)
                if not client.alive(reservation):  # reclaimed with the connection: nothing was stored
                    return [False] * len(keys)
                client.commit(reservation)
            except BaseException:
                try:  # the reservation's own connection, or nothing: never what a newer one reserved
                    client.abort(reservation)
                except HpkvError:
                    pass  # a vanished server's reservations vanish with it
                raise
        self.stats.saved(
            len(held), len(keys) - len(held), len(held) * layout.entry_bytes, time.perf_counter() - started
        )
        return [True] * len(keys)

    def clear(self) -> None:
        """This namespace, DRAM and storage. Not prefaulted: a clear before any storage thread has
        mapped the pool must not populate all of it for one message."""
        ns, _ = self._registered()
        with Client(self.pool_dir, kind="sglang-clear", prefault=False, trusted_uids=self.trusted_uids) as client:
            client.clear(dram=True, storage=True, ns=ns)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            clients, self._clients = list(self._clients.values()), {}
            if self._spare is not None:
                clients.append(self._spare)
                self._spare = None
        for client in clients:
            client.close()

    def _registered(self) -> tuple[str, lay.PageLayout]:
        """This rank's namespace and page layout (SGLang calls register_mem_pool_host before any I/O)."""
        assert self.desc is not None and self.layout is not None, "register_mem_pool_host comes first"
        return self.desc.ns, self.layout

    def client(self) -> Client:
        """This thread's client, registered in this rank's namespace."""
        client = getattr(self._local, "client", None)
        if client is None:
            client, registered = self._new_client()
            self._local.client = client
            self._local.registered = registered
        if not self._local.registered:
            assert self.desc is not None  # register_mem_pool_host comes before any I/O
            client.register(self.desc)
            self._local.registered = True
        return client

    def _new_client(self) -> tuple[Client, bool]:
        """A client for this thread (the one connected early, if not taken yet), and whether it
        is registered. SGLang restarts its storage threads (on /flush_cache, for one), so the
        clients of threads that ended are closed here."""
        this = threading.current_thread()
        with self._lock:
            client, self._spare = self._spare, None
        registered = client is not None
        if client is None:
            client = Client(
                self.pool_dir, kind=f"sglang-{this.name}", prefault=self.prefault, trusted_uids=self.trusted_uids
            )
        with self._lock:
            if self.closed:
                client.close()
                raise ServerUnavailable("the HPKV storage backend is closed")
            ended = [thread for thread in self._clients if not thread.is_alive()]
            for thread in ended:
                self._clients.pop(thread).close()
            self._clients[this] = client
        return client, registered

    def run(self, what: str, miss, fn, *args):
        """`fn(*args)`, or `miss` on any fault: SGLang's threads never get an exception."""
        if self.closed or self.desc is None:
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
            log.error(
                "HPKV %s failed unexpectedly, SGLang recomputes (next %.0f s of such failures logged at debug)",
                what,
                FAULT_LOG_INTERVAL_S,
                exc_info=exc,
            )
        else:
            log.warning(
                "HPKV %s failed, SGLang recomputes (next %.0f s of such faults logged at debug): %s",
                what,
                FAULT_LOG_INTERVAL_S,
                exc,
            )


def _wait(client: Client, lease) -> int:
    deadline = time.monotonic() + PROMOTION_WAIT_S
    num_ready = client.wait(lease, timeout_s=PROMOTION_WAIT_S)
    while num_ready is None and time.monotonic() < deadline:
        num_ready = client.wait(lease, timeout_s=max(0.0, deadline - time.monotonic()))
    return num_ready or 0
