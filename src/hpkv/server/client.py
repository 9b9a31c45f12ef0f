"""The client library engine processes use to talk to the node's HPKV Server: the requests.

    client = Client(settings.pool.dir, kind="worker")
    ns = client.register(desc)
    hit = client.lookup(ns, keys)                # leading hits and their tiers
    res = client.reserve(ns, keys)               # copy into res.view(i), then:
    client.commit(ns, keys, reservation=res)     # or client.abort(ns, keys, reservation=res)
    lease = client.lease(ns, keys)               # lease.wait() -> entries ready; copy from lease.view(i)
    client.release(lease)

Owns the request API and the handles (`Reservation`, `LeaseHandle`); the connection, its trust
checks, reconnection and the pool mapping are `channel.Channel`'s. Every call is bounded
by `timeout_s`; an unreachable server raises `ServerUnavailable` at once and the caller treats
everything as a miss. A handle is only as good as the connection that made it (the server
reclaims its slots when that connection ends): `holds(handle)` says whether it still is, and
`commit`/`abort` given a reservation do nothing unless it is, and never connect. Give each
thread that copies its own Client, so one thread's timeout cannot close another's connection
mid-copy. Knows nothing of the server's store.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..keys import NamespaceDesc
from ..pool.region import PoolRegion
from ..stats import ServerStats
from ..stats import from_wire as stats_from_wire
from ..tiers import Lookup, Tier
from . import protocol as p
from .autostart import ServerUnavailable
from .channel import MAX_RETRY_S, Channel, ServerError, _expect

__all__ = ["MAX_RETRY_S", "Client", "LeaseHandle", "Reservation", "ServerError", "ServerUnavailable"]

_TIERS = {int(t): t for t in Tier}  # wire code -> Tier, without Enum's slow constructor


@dataclass
class Reservation:
    region: PoolRegion
    entry_bytes: int
    offsets: list[int | None]  # None: skip this key (held already, or no room)
    epoch: int = 0
    deadline: float = math.inf  # time.monotonic() past which the server may have taken the slots back

    def view(self, i: int) -> memoryview:
        offset = self.offsets[i]
        if offset is None:
            raise ValueError(f"key {i} of this reservation has no slot (held already, or no room)")
        return self.region.view(offset, self.entry_bytes)


@dataclass
class LeaseHandle:
    id: int
    region: PoolRegion
    entry_bytes: int
    offsets: list[int]
    num_ready: int | None
    epoch: int
    deadline: float = math.inf  # as Reservation's

    def view(self, i: int) -> memoryview:
        return self.region.view(self.offsets[i], self.entry_bytes)


class Client(Channel):
    """The requests to the server, over the connection it inherits."""

    def register(self, desc: NamespaceDesc) -> str:
        reply = self._ask(p.Register(desc.to_json()), p.Registered)
        self._namespaces[reply.ns] = (desc.to_json(), reply.entry_bytes)
        return reply.ns

    def lookup(self, ns: str, keys: Sequence[bytes]) -> Lookup:
        return Lookup(tuple(map(_TIERS.__getitem__, self._ask(p.Lookup(ns, _as_list(keys)), p.Hits).tiers)))

    def reserve(self, ns: str, keys: Sequence[bytes], hold: str = "") -> Reservation:
        """With `hold`, the reservation is settled by whoever calls `settle(hold)` (this client
        neither commits nor aborts it)."""
        with self._lock:
            deadline = self._deadline()
            offsets = self._ask(p.Reserve(ns, _as_list(keys), hold), p.Offsets).offsets
            return Reservation(self._region(), self._namespaces[ns][1], offsets, self.epoch, deadline)

    def commit(self, ns: str, keys: Sequence[bytes], *, reservation: Reservation | None = None) -> int:
        """Publish reserved keys; returns how many were. With `reservation` (the handle that
        reserved them), 0 and nothing sent unless the connection that made it is the live one
        (else a reservation of the same keys made since would be published before it is copied
        into). Without it, any reservation of the keys the live connection holds is published."""
        with self._lock:
            if not self._live(reservation):
                return 0
            return _expect(self._roundtrip(p.Commit(ns, _as_list(keys)), self.timeout_s), p.Count).num

    def abort(self, ns: str, keys: Sequence[bytes], hold: str = "", *, reservation: Reservation | None = None) -> None:
        """Give back reserved slots (those reserved in `hold`, with one: its owner may always
        give them back, never commit them). With `reservation`, only if the connection that made
        it is the live one: slots a newer one reserved may be being copied into."""
        with self._lock:
            if self._live(reservation):
                self._roundtrip(p.Abort(ns, _as_list(keys), hold), self.timeout_s)

    def _live(self, reservation: Reservation | None) -> bool:
        """Connected, and (given a reservation) on the connection that made it. Caller holds the
        lock. Never connects: a new connection holds no reservation to commit or abort."""
        return self._sock is not None and (reservation is None or reservation.epoch == self.epoch)

    def settle(self, hold: str, abort: Sequence[bytes]) -> p.Settled:
        """Commit every client's reservations made with `hold`, except the keys in `abort`."""
        return self._ask(p.Settle(hold, _as_list(abort)), p.Settled)

    def lease(self, ns: str, keys: Sequence[bytes]) -> LeaseHandle:
        with self._lock:
            deadline = self._deadline()
            r = self._ask(p.Lease(ns, _as_list(keys)), p.Leased)
            return LeaseHandle(
                r.lease_id, self._region(), self._namespaces[ns][1], r.offsets, r.num_ready, self.epoch, deadline
            )

    def wait(self, lease: LeaseHandle, timeout_s: float = 5.0) -> int | None:
        """Entries of the lease ready to copy from, or None if promotions are still running."""
        if lease.num_ready is not None:
            return lease.num_ready
        with self._lock:
            if lease.epoch != self.epoch:
                return 0  # the connection that held it is gone, and the lease with it
            r = self._ask(p.LeaseWait(lease.id, timeout_s), p.Leased, timeout_s + self.timeout_s)
        lease.num_ready = r.num_ready
        return r.num_ready

    def release(self, lease: LeaseHandle) -> None:
        with self._lock:
            if self.holds(lease):
                self._call(p.Release(lease.id))

    def holds(self, handle: LeaseHandle | Reservation) -> bool:
        """Whether the server still holds `handle`'s slots for us: the connection that made it is
        the live one, and the server's time limit on it (HPKV_SERVER_SLOT_TIMEOUT_S) has not
        passed. Lock-free: the epoch is read first, and it bumps before the connection closes
        (`_drop`)."""
        return handle.epoch == self.epoch and self._sock is not None and time.monotonic() < handle.deadline

    def clear(self, dram: bool = True, storage: bool = False, ns: str | None = None) -> p.Cleared:
        return self._ask(p.Clear(dram, storage, ns), p.Cleared, max(self.timeout_s, 300.0))

    def stats(self, after: str = "", max_namespaces: int = 256, busiest: bool = False) -> ServerStats:
        """The server's snapshot with one page of its namespaces (`protocol.Stats`; the page after
        starts past `namespace_summary.next_after`); `StatsMismatch` if it does not fit `hpkv.stats`."""
        return stats_from_wire(self._ask(p.Stats(after, max_namespaces, busiest), p.StatsReply).stats)

    def all_stats(self) -> ServerStats:
        """The snapshot with every namespace, asked for page by page (the rest is the first page's)."""
        stats = self.stats()
        after = stats.namespace_summary.next_after
        while after is not None:
            page = self.stats(after, 4096)
            stats.namespaces.update(page.namespaces)
            after = page.namespace_summary.next_after
        stats.namespace_summary.next_after = None
        return stats


def _as_list(keys: Sequence[bytes]) -> list[bytes]:
    """Keys as the list a message holds: typed keys (`keys.Key`) are bytes; a list goes as it is."""
    return keys if isinstance(keys, list) else list(keys)
