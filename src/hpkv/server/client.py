"""The client library engine processes use to talk to the node's HPKV Server: the requests.

    client = Client(settings.pool.dir, kind="worker")
    ns = client.register(desc)
    hit = client.lookup(ns, keys)                # leading hits and their tiers
    res = client.reserve(ns, keys)               # copy into res.view(i), then:
    client.commit(res)                           # or client.abort(res)
    lease = client.lease(ns, keys)               # lease.tiers; client.wait(lease) -> entries ready
    client.release(lease)                        # after copying from lease.view(i)

Each request has a batched form over several namespaces, one round trip whatever their number
(`lookup_many`, `lease_many`, `reserve_many`, `wait_all`, `release(*leases)`): an engine asks
the same number of requests whatever its ranks, KV cache groups and blocks.
Owns the request API and the handles (`Reservation`, `LeaseHandle`); the connection, its trust
checks, reconnection and the pool mapping are `channel.Channel`'s. Every call is bounded
by `timeout_s`; an unreachable server raises `ServerUnavailable` at once and the caller treats
everything as a miss. A handle is only as good as the connection that made it (the server
reclaims its slots when that connection ends): `alive(handle)` says whether it still is, and
`commit`/`abort`/`release`/`wait` do nothing for a handle that is not, and never connect for it.
Give each thread that copies its own Client, so one thread's timeout cannot close another's
connection mid-copy. Knows nothing of the server's store.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ..keys import NamespaceDesc
from ..pool.region import PoolRegion
from ..stats import ServerStats
from ..stats import from_wire as stats_from_wire
from ..tiers import Lookup, Tier
from . import protocol as p
from .autostart import ServerUnavailable
from .channel import MAX_RETRY_S, Channel, ServerError, _expect

__all__ = ["MAX_RETRY_S", "Client", "LeaseHandle", "Part", "Reservation", "ServerError", "ServerUnavailable"]

_TIERS = {int(t): t for t in Tier}  # wire code -> Tier, without Enum's slow constructor
Part = tuple[str, Sequence[bytes]]  # (namespace, keys) of a batched request


@dataclass
class Reservation:
    """Slots of one `Reserve`, in one or more namespaces; committed or aborted whole, by id."""

    id: int
    region: PoolRegion
    part_bytes: list[int]  # each part's entry size
    part_offsets: list[list[int | None]]  # each part's slots; None: skip this key (held already, or no room)
    epoch: int = 0
    deadline: float = math.inf  # time.monotonic() past which the server may have taken the slots back

    @property
    def offsets(self) -> list[int | None]:
        """The slots of a reservation of one namespace."""
        (offsets,) = self.part_offsets
        return offsets

    @property
    def entry_bytes(self) -> int:
        (size,) = self.part_bytes
        return size

    def view(self, i: int, part: int = 0) -> memoryview:
        offset = self.part_offsets[part][i]
        if offset is None:
            raise ValueError(f"key {i} of this reservation has no slot (held already, or no room)")
        return self.region.view(offset, self.part_bytes[part])


@dataclass
class LeaseHandle:
    id: int
    region: PoolRegion
    entry_bytes: int
    offsets: list[int]
    num_ready: int | None
    epoch: int
    deadline: float = math.inf  # as Reservation's
    tiers: tuple[Tier, ...] = ()  # of each entry leased, as the lease found it (storage: promoted)

    def view(self, i: int) -> memoryview:
        return self.region.view(self.offsets[i], self.entry_bytes)


class Client(Channel):
    """The requests to the server, over the connection it inherits."""

    def register(self, desc: NamespaceDesc) -> str:
        reply = self._ask(p.Register(desc.to_json()), p.Registered)
        self._namespaces[reply.ns] = (desc.to_json(), reply.entry_bytes)
        return reply.ns

    def lookup(self, ns: str, keys: Sequence[bytes]) -> Lookup:
        (tiers,) = self.lookup_many([(ns, keys)])
        return Lookup(tuple(map(_TIERS.__getitem__, tiers)))

    def lookup_many(self, parts: Sequence[Part], each: Collection[int] = ()) -> list[bytes]:
        """Each part's tiers as wire codes (1 DRAM, 2 storage): one per leading hit, or, for the
        parts whose index is in `each`, one per key, 0 for a miss."""
        if not parts:
            return []
        return self._ask(p.Lookup(_parts(parts), sorted(each)), p.Hits).tiers

    def reserve(self, ns: str, keys: Sequence[bytes], hold: str = "") -> Reservation:
        """With `hold`, the reservation is settled by whoever calls `settle(hold)` (this client
        neither commits nor aborts it; it may abort it)."""
        return self.reserve_many([(ns, keys)], hold)

    def reserve_many(self, parts: Sequence[Part], hold: str = "") -> Reservation:
        with self._lock:
            deadline = self._deadline()
            r = self._ask(p.Reserve(_parts(parts), hold), p.Reserved)
            sizes = [self._namespaces[ns][1] for ns, _ in parts]
            return Reservation(r.reservation_id, self._region(), sizes, r.offsets, self.epoch, deadline)

    def commit(self, reservation: Reservation) -> int:
        """Publish a reservation's slots; returns how many were. 0 and nothing sent unless the
        connection that made it is the live one (a reservation of the same keys made since may
        not be copied into yet)."""
        with self._lock:
            if not self._live(reservation):
                return 0
            return _expect(self._roundtrip(p.Commit(reservation.id), self.timeout_s), p.Count).num

    def abort(self, reservation: Reservation) -> None:
        """Give a reservation's slots back (one in a hold too: its owner may always give them
        back, never commit them); only on the connection that made it."""
        with self._lock:
            if self._live(reservation):
                self._roundtrip(p.Abort(reservation.id), self.timeout_s)

    def _live(self, handle: Reservation | LeaseHandle) -> bool:
        """Connected, on the connection that made `handle`. Caller holds the lock. Never
        connects: a new connection holds nothing of an old one's."""
        return self._sock is not None and handle.epoch == self.epoch

    def settle(self, hold: str, abort: Sequence[bytes]) -> p.Settled:
        """Commit every client's reservations made with `hold`, except the keys in `abort`."""
        return self._ask(p.Settle(hold, _as_list(abort)), p.Settled)

    def lease(self, ns: str, keys: Sequence[bytes]) -> LeaseHandle:
        (lease,) = self.lease_many([(ns, keys)])
        return lease

    def lease_many(self, parts: Sequence[Part]) -> list[LeaseHandle]:
        """One lease per part, each with the tiers of what it leased (its leading hits)."""
        if not parts:
            return []
        with self._lock:
            deadline = self._deadline()
            r = self._ask(p.Lease(_parts(parts)), p.Leased)
            region = self._region()
            return [
                LeaseHandle(
                    got.lease_id,
                    region,
                    self._namespaces[ns][1],
                    got.offsets,
                    got.num_ready,
                    self.epoch,
                    deadline,
                    tuple(map(_TIERS.__getitem__, got.tiers)),
                )
                for (ns, _), got in zip(parts, r.leases, strict=True)
            ]

    def wait(self, lease: LeaseHandle, timeout_s: float = 5.0) -> int | None:
        """Entries of the lease ready to copy from, or None if promotions are still running."""
        (num_ready,) = self.wait_all([lease], timeout_s)
        return num_ready

    def wait_all(self, leases: Sequence[LeaseHandle], timeout_s: float = 5.0) -> list[int | None]:
        """For each lease, its entries ready to copy from (0 for one whose connection is gone),
        or None while its promotions run; the server waits up to `timeout_s` for all of them,
        in one round trip."""
        if all(lease.num_ready is not None for lease in leases):
            return [lease.num_ready for lease in leases]
        with self._lock:
            asked = [lease for lease in leases if lease.num_ready is None and self._live(lease)]
            if asked:
                reply = self._ask(
                    p.LeaseWait([lease.id for lease in asked], timeout_s), p.Ready, timeout_s + self.timeout_s
                )
                for lease, num_ready in zip(asked, reply.num_ready, strict=True):
                    lease.num_ready = num_ready
            return [lease.num_ready if lease.num_ready is not None or self._live(lease) else 0 for lease in leases]

    def release(self, *leases: LeaseHandle) -> None:
        """Unpin the leases (those still held: on the live connection), in one round trip."""
        with self._lock:
            ids = [lease.id for lease in leases if lease.id and self.alive(lease)]  # 0: a miss, nothing held
            if ids:
                self._call(p.Release(ids))

    def alive(self, handle: LeaseHandle | Reservation) -> bool:
        """Whether the server still holds `handle`'s slots for us: the connection that made it is
        the live one, and the server's time limit on it (HPKV_SERVER_SLOT_TIMEOUT_S) has not
        passed. Lock-free: the epoch is read first, and it bumps before the connection closes
        (`_drop`)."""
        return handle.epoch == self.epoch and self._sock is not None and time.monotonic() < handle.deadline

    def clear(self, dram: bool = True, storage: bool = False, ns: str | None = None) -> p.Cleared:
        return self._ask(p.Clear(dram, storage, ns), p.Cleared, max(self.timeout_s, 300.0))

    def journal(
        self,
        cursors: Sequence[tuple[str, int]],
        held: Sequence[Part] = (),
        describe: Sequence[p.Described] = (),
        snapshot: Sequence[p.Snapshot] = (),
    ) -> p.JournalPages:
        """The tier journal's records past each (ns, cursor) (-1: watch it from now), and the tiers
        holding the keys of `held`, in one round trip (`protocol.Journal`); with it, block
        descriptions given to the server (`describe`) and pages of those it kept (`snapshot`)."""
        cursor_list = [p.Cursor(ns, after) for ns, after in cursors]
        return self._ask(p.Journal(cursor_list, _parts(held), list(describe), list(snapshot)), p.JournalPages)

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


def _parts(parts: Sequence[Part]) -> list[p.Part]:
    return [p.Part(ns, _as_list(keys)) for ns, keys in parts]


def _as_list(keys: Sequence[bytes]) -> list[bytes]:
    """Keys as the list a message holds: typed keys (`keys.Key`) are bytes; a list goes as it is."""
    return keys if isinstance(keys, list) else list(keys)
