"""The HPKV Server's answer to each request: one method per request type, on the store.

Owns the dispatch of a decoded request, each connection's open reservations (by the id `Reserve`
answered, at most MAX_OPEN_KEYS keys: `Commit` and `Abort` name them), and the mapping of
failures to protocol errors: a
namespace no client registered is `UnknownNamespace` (looked up explicitly, so a KeyError from a
bug is reported as the bug it is), a bad argument is `bad_request`, anything else is `internal`
and logged with its traceback. Primitives: `Handlers.handle(request, client)`, and `ClientInfo`,
the state of one connection the handlers read and write. Must not know sockets or framing, nor
the server's start and stop.
"""

from __future__ import annotations

import functools
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
# Keys one connection may hold reserved and not committed, aborted or settled: the server keeps
# their names until then (a reservation is committed or aborted by its id, not by its keys).
MAX_OPEN_KEYS = 1 << 16
MAX_WAIT_S = 60.0  # the longest a LeaseWait is answered after
JOURNAL_REPLY_RECORDS = 1 << 15  # records in one Journal reply, shared by its cursors (a reply fits a frame)
MAX_DESC_BYTES = 1 << 20  # HPKV_SERVER_MAX_NAMESPACE_BYTES at most: a stats page holds at least one description


class UnknownNamespace(HpkvError):
    """A request names a namespace no client registered with this server."""

    def __init__(self, ns: str) -> None:
        super().__init__(f"namespace {ns!r} is not registered; send Register first")
        self.ns = ns


@dataclass
class OpenReservation:
    """What one `Reserve` of a connection took and has not committed or aborted yet."""

    hold: str
    parts: list[tuple[str, list[bytes]]]  # (ns, the keys that got a slot)


@dataclass
class ClientInfo:
    id: int
    pid: int
    uid: int
    kind: str = "?"
    connected_at: float = field(default_factory=time.time)
    leases: set[int] = field(default_factory=set)
    reservations: dict[int, OpenReservation] = field(default_factory=dict)  # by the id `Reserved` named
    reserved_keys: int = 0  # in `reservations`: at most MAX_OPEN_KEYS
    watching: set[str] = field(default_factory=set)  # namespaces whose journal it reads (kept while it does)
    next_reservation: int = 0
    after_reply: Callable[[], None] | None = None  # work that must not delay the reply

    def take_reservation(self, rid: int) -> OpenReservation | None:
        res = self.reservations.pop(rid, None)
        if res is not None:
            self.reserved_keys -= sum(len(keys) for _, keys in res.parts)
        return res


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
        for part in r.parts:
            self._check_ns(part.ns)
        each = set(r.each)
        return p.Hits(
            [
                self.store.lookup_each(part.ns, part.keys)
                if i in each
                else bytes(self.store.lookup(part.ns, part.keys).tiers)
                for i, part in enumerate(r.parts)
            ]
        )

    def _on_Reserve(self, r: p.Reserve, client: ClientInfo) -> p.Reply:
        for part in r.parts:
            self._check_ns(part.ns)
            long_keys = [key for key in part.keys if len(key) > MAX_KEY_BYTES]
            if long_keys:  # each becomes a file name: make_key digests longer ones
                return p.Error(
                    "bad_request",
                    f"{len(long_keys)} key(s) longer than {MAX_KEY_BYTES} bytes (the first "
                    f"is {len(long_keys[0])}); build keys with hpkv.keys.make_key",
                )
        if len(r.hold) > MAX_HOLD_CHARS:
            return p.Error("bad_request", f"hold name of {len(r.hold)} characters; at most {MAX_HOLD_CHARS}")
        num_keys = sum(len(part.keys) for part in r.parts)
        if client.reserved_keys + num_keys > MAX_OPEN_KEYS:
            self._forget_settled(client)  # the holds settled since no longer count
            if client.reserved_keys + num_keys > MAX_OPEN_KEYS:
                return p.Error(
                    "limit",
                    f"this connection would have {client.reserved_keys + num_keys} keys reserved and not yet "
                    f"committed, aborted or settled, over the limit of {MAX_OPEN_KEYS} "
                    "(hpkv.server.handlers.MAX_OPEN_KEYS); commit or abort reservations first",
                )
        client.next_reservation += 1
        rid = client.next_reservation
        offsets, reserved = [], OpenReservation(r.hold, [])
        try:
            for part in r.parts:
                got = self.store.reserve(part.ns, part.keys, owner=client.id, hold=r.hold)
                offsets.append(got)
                taken = [key for key, offset in zip(part.keys, got, strict=True) if offset is not None]
                if taken:
                    reserved.parts.append((part.ns, taken))
                    client.reserved_keys += len(taken)
        finally:  # what a failed part leaves reserved is the connection's to abort, or goes with it
            if reserved.parts:
                client.reservations[rid] = reserved
        return p.Reserved(rid, offsets)

    def _on_Commit(self, r: p.Commit, client: ClientInfo) -> p.Reply:
        res = client.reservations.get(r.reservation_id)
        if res is not None and res.hold:
            return p.Error(
                "bad_request",
                f"reservation {r.reservation_id} is in hold {res.hold!r}: settled by Settle, not committed",
            )
        res = client.take_reservation(r.reservation_id)
        if res is None:
            return p.Count(0)
        return p.Count(sum(self.store.commit(ns, keys, owner=client.id) for ns, keys in res.parts))

    def _on_Abort(self, r: p.Abort, client: ClientInfo) -> p.Reply:
        res = client.take_reservation(r.reservation_id)
        if res is None:
            return p.Count(0)
        return p.Count(sum(self.store.abort(ns, keys, owner=client.id, hold=res.hold) for ns, keys in res.parts))

    def _forget_settled(self, client: ClientInfo) -> None:
        """Drop the connection's reservations in holds that have ended (settled by whoever
        settles them, or timed out): nothing of them is left to abort."""
        for rid, res in list(client.reservations.items()):
            if res.hold and not self.store.has_reservations(client.id, res.hold):
                client.take_reservation(rid)

    def _on_Settle(self, r: p.Settle, client: ClientInfo) -> p.Reply:
        return p.Settled(*self.store.settle(r.hold, r.abort))

    def _on_Lease(self, r: p.Lease, client: ClientInfo) -> p.Reply:
        for part in r.parts:
            self._check_ns(part.ns)
        leases, parts = [], []
        for part in r.parts:
            lease = self.store.lease(part.ns, part.keys, owner=client.id, start_reads=False)
            if not lease.entries:  # a miss pins nothing: lease 0, nothing to release
                self.store.release(lease.id)
                parts.append(p.LeasePart(0, b"", [], 0))
                continue
            client.leases.add(lease.id)
            leases.append(lease)
            num_ready = None if lease.reads or not lease.done else lease.wait()
            parts.append(p.LeasePart(lease.id, lease.tiers, lease.offsets, num_ready))
        reading = [lease for lease in leases if lease.reads]
        if reading:  # the storage reads queued once the reply is sent
            client.after_reply = functools.partial(_start_reads, reading)
        return p.Leased(parts)

    def _on_LeaseWait(self, r: p.LeaseWait, client: ClientInfo) -> p.Reply:
        leases = [self.store.get_lease(i) if i in client.leases else None for i in r.lease_ids]
        for lease_id, lease in zip(r.lease_ids, leases):
            if lease is None:
                return p.Error(
                    "bad_request",
                    f"lease {lease_id} is not held by this client (released, or held "
                    f"past HPKV_SERVER_SLOT_TIMEOUT_S={self.settings.server_slot_timeout_s:g} s)",
                )
        deadline = time.monotonic() + max(0.0, min(r.timeout_s, MAX_WAIT_S))
        ready: list[int | None] = []
        for lease in leases:
            assert lease is not None
            try:  # one deadline for all: the wait ends once every lease is ready, or at it
                ready.append(lease.wait(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                ready.append(None)
        return p.Ready(ready)

    def _on_Release(self, r: p.Release, client: ClientInfo) -> p.Reply:
        num = 0
        for lease_id in r.lease_ids:
            if lease_id in client.leases:
                client.leases.discard(lease_id)
                num += int(self.store.release(lease_id))
        return p.Count(num)

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

    def _on_Journal(self, r: p.Journal, client: ClientInfo) -> p.Reply:
        named = [c.ns for c in r.cursors] + [part.ns for part in r.held] + [d.ns for d in r.describe]
        for ns in named + [s.ns for s in r.snapshot] + [ns for s in r.snapshot for ns in s.held_in]:
            self._check_ns(ns)
        _check_described(r)
        for described in r.describe:  # before the pages: a record of these keys read now may drop them
            self.store.watches.describe(described.ns, described.keys, described.blobs)
        share = max(256, JOURNAL_REPLY_RECORDS // max(1, len(r.cursors)))
        pages = []
        for cursor in r.cursors:
            page = self.store.watches.read(cursor.ns, cursor.after, share) if cursor.after >= 0 else None
            if page is None:  # watched from now; a cursor into a journal that is not kept is lost
                last = self.store.watches.watch(cursor.ns, client.id)
                pages.append(p.JournalPage(cursor.ns, b"", [], last, cursor.after >= 0, False))
            else:
                if cursor.ns not in client.watching:  # its journal is kept while this client reads it too
                    self.store.watches.watch(cursor.ns, client.id)
                pages.append(p.JournalPage(cursor.ns, page.codes, page.keys, page.last, page.lost, page.more))
            client.watching.add(cursor.ns)
        held = [self.store.watches.held(part.ns, part.keys) for part in r.held]
        snapshot = []
        for s in r.snapshot:  # after the pages: what a tier holds now, past the records read
            share = p.SNAPSHOT_REPLY_BYTES // len(r.snapshot)
            kept, bits = self.store.watches.snapshot(s.ns, s.after, s.held_in, p.SNAPSHOT_PAGE_KEYS, share)
            snapshot.append(p.SnapshotPage(s.ns, kept.keys, kept.blobs, bits, kept.last, kept.more))
        return p.JournalPages(self.store.watches.journal.life, pages, held, snapshot)

    def _on_Stats(self, r: p.Stats, client: ClientInfo) -> p.Reply:
        stats = self._stats()
        stats.namespaces, stats.namespace_summary.next_after = namespace_page(stats.namespaces, r)
        return p.StatsReply(msgspec.to_builtins(stats))

    def _check_ns(self, ns: str) -> None:
        if ns not in self.store.namespaces():
            raise UnknownNamespace(ns)


def _check_described(r: p.Journal) -> None:
    """A `Journal`'s descriptions and snapshots within the protocol's bounds (ValueError: `bad_request`)."""
    if any(len(d.keys) != len(d.blobs) for d in r.describe):
        raise ValueError("Journal.describe: one blob per key")
    if sum(len(d.keys) for d in r.describe) > p.MAX_DESCRIBED:
        raise ValueError(f"Journal.describe: more than {p.MAX_DESCRIBED} descriptions in one request")
    if len(r.snapshot) > p.MAX_SNAPSHOTS or sum(len(s.held_in) for s in r.snapshot) > p.MAX_SNAPSHOT_NAMESPACES:
        limits = f"{p.MAX_SNAPSHOTS} snapshots and {p.MAX_SNAPSHOT_NAMESPACES} held_in"
        raise ValueError(f"Journal.snapshot: at most {limits} in one request")


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


def _start_reads(leases: list) -> None:
    for lease in leases:
        lease.start_reads()


def _is_ns_id(text: str) -> bool:
    return len(text) == 2 * NS_DIGEST_BYTES and all(c in "0123456789abcdef" for c in text)
