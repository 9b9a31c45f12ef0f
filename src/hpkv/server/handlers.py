"""The HPKV Server's answer to each request: one method per request type, on the store.

Owns the dispatch of a decoded request and the mapping of failures to protocol errors: a
namespace no client registered is `UnknownNamespace` (looked up explicitly, so a KeyError from a
bug is reported as the bug it is), a bad argument is `bad_request`, anything else is `internal`
and logged with its traceback. Primitives: `Handlers.handle(request, client)`, and `ClientInfo`,
the state of one connection the handlers read and write. Must not know sockets or framing, nor
the server's start and stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import msgspec

from ..config import Settings
from ..errors import HpkvError
from ..keys import MAX_KEY_BYTES, NS_DIGEST_BYTES, NamespaceDesc
from ..stats import NamespaceStats, ServerStats
from ..store import TieredStore
from ..store.owners import NamespaceLimits
from . import protocol as p

log = logging.getLogger("hpkv.server")

MAX_HOLD_CHARS = 128
MAX_DESC_BYTES = 1 << 20  # HPKV_SERVER_MAX_NAMESPACE_BYTES at most: a stats page holds at least one description


class UnknownNamespace(HpkvError):
    """A request names a namespace no client registered with this server."""

    def __init__(self, ns: str) -> None:
        super().__init__(f"namespace {ns!r} is not registered; send Register first")
        self.ns = ns


@dataclass
class ClientInfo:
    id: int
    pid: int
    uid: int
    kind: str = "?"
    connected_at: float = field(default_factory=time.time)
    leases: set[int] = field(default_factory=set)
    after_reply: Callable[[], None] | None = None  # work that must not delay the reply


class Handlers:
    """The request handlers of one server; `stats()` is the snapshot `Stats` is answered with."""

    def __init__(self, store: TieredStore, settings: Settings, stats: Callable[[], ServerStats]) -> None:
        self.store = store
        self.settings = settings
        self._stats = stats
        store.set_limits(  # here, beside the Register they bound
            NamespaceLimits(
                min(settings.server_max_namespace_bytes, MAX_DESC_BYTES),
                settings.server_max_namespaces_per_uid,
                settings.server_max_namespaces,
            )
        )

    def handle(self, request: p.Request, client: ClientInfo) -> p.Reply:
        handler = getattr(self, "_on_" + type(request).__name__, None)
        if handler is None:
            return p.Error("bad_request", f"{type(request).__name__} is not valid here")
        try:
            return handler(request, client)
        except UnknownNamespace as exc:
            return p.Error("unknown_namespace", str(exc))
        except (HpkvError, ValueError, TypeError) as exc:
            return p.Error("bad_request", str(exc))
        except Exception as exc:  # a bug: keep serving everyone else
            log.exception("internal error handling %s", type(request).__name__)
            return p.Error("internal", f"internal server error: {exc!r}")

    def _on_Register(self, r: p.Register, client: ClientInfo) -> p.Reply:
        self.store.check_desc_size(len(r.desc_json))  # before parsing: its characters are at most its bytes
        try:
            desc = NamespaceDesc.from_json(r.desc_json)
        except (ValueError, TypeError, AttributeError) as exc:  # JSON of the wrong shape is the peer's fault
            return p.Error("bad_request", f"not a namespace description ({exc}): {r.desc_json[:200]!r}")
        return p.Registered(self.store.register(desc, owner=client.id, uid=client.uid), desc.entry_bytes)

    def _on_Lookup(self, r: p.Lookup, client: ClientInfo) -> p.Reply:
        self._check_ns(r.ns)
        return p.Hits(bytes(self.store.lookup(r.ns, r.keys).tiers))

    def _on_Reserve(self, r: p.Reserve, client: ClientInfo) -> p.Reply:
        self._check_ns(r.ns)
        long_keys = [key for key in r.keys if len(key) > MAX_KEY_BYTES]
        if long_keys:  # each becomes a file name: make_key digests longer ones
            return p.Error(
                "bad_request",
                f"{len(long_keys)} key(s) longer than {MAX_KEY_BYTES} bytes (the first "
                f"is {len(long_keys[0])}); build keys with hpkv.keys.make_key",
            )
        if len(r.hold) > MAX_HOLD_CHARS:
            return p.Error("bad_request", f"hold name of {len(r.hold)} characters; at most {MAX_HOLD_CHARS}")
        return p.Offsets(self.store.reserve(r.ns, r.keys, owner=client.id, hold=r.hold))

    def _on_Commit(self, r: p.Commit, client: ClientInfo) -> p.Reply:
        return p.Count(self.store.commit(r.ns, r.keys, owner=client.id))

    def _on_Abort(self, r: p.Abort, client: ClientInfo) -> p.Reply:
        return p.Count(self.store.abort(r.ns, r.keys, owner=client.id, hold=r.hold))

    def _on_Settle(self, r: p.Settle, client: ClientInfo) -> p.Reply:
        return p.Settled(*self.store.settle(r.hold, r.abort))

    def _on_Lease(self, r: p.Lease, client: ClientInfo) -> p.Reply:
        self._check_ns(r.ns)
        lease = self.store.lease(r.ns, r.keys, owner=client.id, start_reads=False)
        client.leases.add(lease.id)
        if lease.reads:
            client.after_reply = lambda: self.store.start_reads(lease)
            return p.Leased(lease.id, lease.offsets, None)
        return p.Leased(lease.id, lease.offsets, lease.wait() if lease.done else None)

    def _on_LeaseWait(self, r: p.LeaseWait, client: ClientInfo) -> p.Reply:
        lease = self.store.get_lease(r.lease_id) if r.lease_id in client.leases else None
        if lease is None:
            return p.Error(
                "bad_request",
                f"lease {r.lease_id} is not held by this client (released, or held "
                f"past HPKV_SERVER_SLOT_TIMEOUT_S={self.settings.server_slot_timeout_s:g} s)",
            )
        try:
            num_ready = lease.wait(timeout=max(0.0, min(r.timeout_s, 60.0)))
        except FutureTimeout:
            num_ready = None
        return p.Leased(lease.id, lease.offsets, num_ready)

    def _on_Release(self, r: p.Release, client: ClientInfo) -> p.Reply:
        if r.lease_id not in client.leases:
            return p.Count(0)
        client.leases.discard(r.lease_id)
        return p.Count(int(self.store.release(r.lease_id)))

    def _on_Clear(self, r: p.Clear, client: ClientInfo) -> p.Reply:
        if r.ns is not None and not _is_ns_id(r.ns):  # it becomes a path under the storage root
            return p.Error(
                "bad_request",
                f"{r.ns[:80]!r} is not a namespace id ({2 * NS_DIGEST_BYTES} hex digits, as `hpkv status` shows them)",
            )
        removed = self.store.clear(dram=r.dram, storage=r.storage, ns=r.ns)
        log.info(
            "cleared %s%s (ns %s) at the request of pid %d: %s",
            "dram " if r.dram else "",
            "storage" if r.storage else "",
            r.ns or "all",
            client.pid,
            removed,
        )
        return p.Cleared(removed["dram"], removed["storage"])

    def _on_Stats(self, r: p.Stats, client: ClientInfo) -> p.Reply:
        stats = self._stats()
        stats.namespaces, stats.namespace_summary.next_after = namespace_page(stats.namespaces, r)
        return p.StatsReply(msgspec.to_builtins(stats))

    def _check_ns(self, ns: str) -> None:
        if ns not in self.store.namespaces():
            raise UnknownNamespace(ns)


def namespace_page(namespaces: dict[str, NamespaceStats], r: p.Stats) -> tuple[dict[str, NamespaceStats], str | None]:
    """The page `r` asks for, and the id the next one starts after (None: no more, or `busiest`).
    Bounded by `r.max_namespaces` and STATS_PAGE_BYTES of descriptions, so that a reply fits a frame."""
    if r.busiest:
        order = sorted(namespaces, key=lambda ns: (-namespaces[ns].lookup_keys, ns))
    else:
        order = sorted(ns for ns in namespaces if ns > r.after)
    page: dict[str, NamespaceStats] = {}
    size = 0
    for ns in order:
        desc_bytes = len(namespaces[ns].desc.encode())
        if len(page) >= r.max_namespaces or (page and size + desc_bytes > p.STATS_PAGE_BYTES):
            break
        page[ns] = namespaces[ns]
        size += desc_bytes
    if r.busiest or len(page) == len(order):
        return page, None
    return page, max(page) if page else r.after


def _is_ns_id(text: str) -> bool:
    return len(text) == 2 * NS_DIGEST_BYTES and all(c in "0123456789abcdef" for c in text)
