"""What each client holds in the pool, and the limits on it: a time limit on every reservation
and lease, and caps on the pool bytes one client process, and one user (all its processes
together), hold reserved or leased at once. Why: a client that never lets go, or takes the whole
pool, would otherwise starve every other engine; one that opens more connections, or forks, must
not get more.

Owns, per owner (a client connection; 0 in process): its reservations (oldest first, with when
each was made), the slot bytes its reservations and leases hold, the groups it counts in (`join`:
its process and its user; an owner that never joined is a group of its own), the bytes each group
holds, and the counters of keys refused at a cap and taken back at the limit; the holds
(reservations named `Reserved(ns, key, hold)`, settled together); and the quarantine: entries
whose holder may still be copying, kept from reuse until a given time.
Primitives: `configure` (or `SlotShares` and `share_bytes`, the server's limits as shares of the
pool), `join`, `leave`, `room(owner)`, `refused`; reservations `has`, `add`, `pop`,
`pop_owner`; leases `leased`, `released`; `expired_reservations`, `expired_leases`; `bytes_taken`, `stats`; the
holds (`holds`: `join`, `end`, `expired`) and the quarantine (`quarantined`: `add`, `over`).
Must not know: the DRAM index, the leases' contents beyond their entries, the protocol (the store
decides what an entry becomes once its quarantine is over). Not thread-safe: the store calls it
under its lock. `clock` is injectable. A store built without limits has none; the server sets
them from HPKV_SERVER_SLOT_TIMEOUT_S, HPKV_SERVER_MAX_SLOT_SHARE (per process) and
HPKV_SERVER_MAX_USER_SLOT_SHARE (per uid).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

from .stats import LimitStats
from .throttle import Throttle

log = logging.getLogger(__name__)

CAP_LOG_INTERVAL_S = 60.0  # a client at its cap is named in the log at most this often
PROCESS, USER = "process", "user"  # the first item of a group's key: which cap applies to it


class Slot(Protocol):
    slot_bytes: int


class Leased(Protocol):  # a `store.Lease`
    id: int
    owner: int
    made_at: float  # on this module's clock
    entries: list


SlotT = TypeVar("SlotT", bound=Slot)  # the store's entries
LeasedT = TypeVar("LeasedT", bound=Leased)


class Reserved(NamedTuple):
    """What an owner reserved: a key, alone or in a hold (`hold` "": its owner commits it)."""

    ns: str
    key: bytes
    hold: str = ""


class SlotShares(NamedTuple):
    """The server's limits on slots: a time limit (None: none) and the shares of the pool one
    client process and one user may hold reserved or leased (1 or more: no cap)."""

    timeout_s: float | None
    process_share: float
    user_share: float


def share_bytes(share: float, pool_bytes: int, slab_bytes: int) -> int | None:
    """The bytes a share of the pool is, for a cap on what is held reserved or leased (None: no
    cap); at least a slab's."""
    if share >= 1:
        return None
    return max(slab_bytes, int(pool_bytes * share))


@dataclass
class HoldPart:
    owner: int
    ns: str
    keys: list[bytes]  # reserved in the hold, each as Reserved(ns, key, hold)


@dataclass
class Hold:
    began_at: float  # on the clock
    parts: list[HoldPart]


@dataclass
class Quarantined(Generic[SlotT]):
    until: float  # on the clock
    entry: SlotT
    leased: bool  # pinned by a lease (the store unpins it after) or reserved (aborted after)


@dataclass
class LimitCounters:
    capped_keys: int = 0  # keys not reserved or leased: their client held its cap already
    expired_reservations: int = 0
    expired_leases: int = 0


class SlotLimits(Generic[SlotT]):
    def __init__(
        self,
        timeout_s: float | None = None,
        max_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_user_bytes: int | None = None,
    ) -> None:
        self.timeout_s = timeout_s  # None: no time limit
        self.max_bytes = max_bytes  # per process; None: no cap
        self.max_user_bytes = max_user_bytes  # per uid; None: no cap
        self.clock = clock
        self.counters = LimitCounters()
        self._reserved: dict[int, dict[Reserved, tuple[SlotT, float]]] = {}  # owner -> name -> (entry, made at)
        self._bytes: dict[int, int] = {}  # owner -> slot bytes reserved or leased
        self._groups: dict[int, tuple[tuple[Hashable, ...], ...]] = {}  # owner -> its groups' keys
        self._group_bytes: dict[tuple[Hashable, ...], int] = {}  # group -> slot bytes its owners hold
        self._left: set[int] = set()  # owners gone that still hold bytes: forgotten once they hold none
        self.holds = Holds(lambda: self.clock())  # `clock` is the one tests may replace
        self.quarantined: Quarantine[SlotT] = Quarantine(lambda: self.clock())
        self._cap_log = Throttle()

    def configure(self, timeout_s: float | None, max_bytes: int | None, max_user_bytes: int | None = None) -> None:
        """The time limit and the caps (per process, per user) in slot bytes; None: none."""
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_user_bytes = max_user_bytes

    def join(self, owner: int, uid: int, pid: int) -> None:
        """`owner` (a connection) counts in the group of process `pid` and of user `uid`; a pid
        the server cannot see (0: another pid namespace) makes the connection a process of its own."""
        process: tuple[Hashable, ...] = (PROCESS, uid, pid) if pid > 0 else (PROCESS, "connection", owner)
        self._groups[owner] = (process, (USER, uid))

    def leave(self, owner: int) -> None:
        """`owner` is gone: forget its groups once it holds nothing (a quarantine may outlast it)."""
        if owner in self._bytes:
            self._left.add(owner)
        else:
            self._groups.pop(owner, None)

    def _groups_of(self, owner: int) -> tuple[tuple[Hashable, ...], ...]:
        return self._groups.get(owner) or ((PROCESS, "owner", owner),)

    def room(self, owner: int) -> float:
        """Slot bytes `owner` may still reserve or lease: the least its groups have left."""
        room = math.inf
        for group in self._groups_of(owner):
            cap = _cap(self, group)
            if cap is not None:
                room = min(room, cap - self._group_bytes.get(group, 0))
        return room

    def refused(self, owner: int, num_keys: int, what: str) -> None:
        """Count keys asked for past the cap (`what`: "reserved" or "leased" they were not)."""
        if not num_keys:
            return
        self.counters.capped_keys += num_keys
        if self._cap_log.allows(self.clock(), CAP_LOG_INTERVAL_S):
            groups = self._groups_of(owner)
            full = [g for g in groups if (cap := _cap(self, g)) is not None and self._group_bytes.get(g, 0) >= cap]
            group = full[-1] if full else groups[0]
            key = "HPKV_SERVER_MAX_USER_SLOT_SHARE" if group[0] == USER else "HPKV_SERVER_MAX_SLOT_SHARE"
            who = f"uid {group[1]}" if group[0] == USER else f"the process of client {owner}"
            log.warning(
                "%s holds its share of the pool (%d bytes, %s) in reservations and leases: %d key(s) "
                "not %s, a miss (counted in the stats' limits, logged once a minute)",
                who,
                _cap(self, group),
                key,
                num_keys,
                what,
            )

    # -- reservations -------------------------------------------------------------------------

    def has(self, owner: int, name: Reserved) -> bool:
        return name in self._reserved.get(owner, ())

    def add(self, owner: int, name: Reserved, entry: SlotT) -> None:
        self._reserved.setdefault(owner, {})[name] = (entry, self.clock())
        self._take(owner, entry.slot_bytes)

    def pop(self, owner: int, name: Reserved) -> SlotT | None:
        """The entry `owner` reserved as `name`, which it holds no more; None if it did not."""
        held = self._reserved.get(owner)
        item = held.pop(name, None) if held else None
        if item is None:
            return None
        if not held:
            del self._reserved[owner]
        self._give(owner, item[0].slot_bytes)
        return item[0]

    def pop_owner(self, owner: int) -> list[SlotT]:
        held = self._reserved.pop(owner, {})
        for entry, _ in held.values():
            self._give(owner, entry.slot_bytes)
        return [entry for entry, _ in held.values()]

    def has_reservations(self, owner: int) -> bool:
        return owner in self._reserved

    @property
    def num_reservations(self) -> int:
        return sum(len(held) for held in self._reserved.values())

    def expired_reservations(self) -> list[tuple[int, Reserved, SlotT]]:
        """Take back the reservations past the time limit: (owner, name, entry) of each, which
        their owners hold no more. Costs one look per owner when none is due."""
        if self.timeout_s is None or not self._reserved:
            return []
        cutoff = self.clock() - self.timeout_s
        due = []
        for owner, held in self._reserved.items():
            for name, (entry, made_at) in held.items():  # oldest first
                if made_at > cutoff:
                    break
                due.append((owner, name, entry))
        for owner, name, _ in due:
            self.pop(owner, name)
        if due:
            self.counters.expired_reservations += len(due)
            self._log_expired(len(due), "reservation", {owner for owner, _, _ in due})
        return due

    # -- leases -------------------------------------------------------------------------------

    def leased(self, owner: int, num_bytes: int) -> None:
        self._take(owner, num_bytes)

    def released(self, owner: int, num_bytes: int, expired: bool = False) -> None:
        self._give(owner, num_bytes)
        self.counters.expired_leases += expired

    def expired_leases(self, leases: Iterable[LeasedT]) -> list[LeasedT]:
        """Of `leases` (oldest first), those past the time limit, booked as released: their
        holder drops them from its table."""
        if self.timeout_s is None:
            return []
        cutoff = self.clock() - self.timeout_s
        due = list(itertools.takewhile(lambda lease: lease.made_at <= cutoff, leases))
        for lease in due:
            self.released(lease.owner, sum(e.slot_bytes for e in lease.entries), expired=True)
        if due:
            self._log_expired(len(due), "lease", {lease.owner for lease in due})
        return due

    def _log_expired(self, num: int, what: str, owners: set[int]) -> None:
        log.warning(
            "%d %s(s) of client(s) %s held past %.0f s (HPKV_SERVER_SLOT_TIMEOUT_S): taken back; "
            "their slots are quarantined before reuse",
            num,
            what,
            sorted(owners),
            self.timeout_s,
        )

    # -- the books ----------------------------------------------------------------------------

    def bytes_taken(self) -> dict[int, int]:
        """owner -> slot bytes it holds reserved or leased now (a copy)."""
        return dict(self._bytes)

    def _take(self, owner: int, num_bytes: int) -> None:
        self._bytes[owner] = self._bytes.get(owner, 0) + num_bytes
        for group in self._groups_of(owner):
            self._group_bytes[group] = self._group_bytes.get(group, 0) + num_bytes

    def _give(self, owner: int, num_bytes: int) -> None:
        for group in self._groups_of(owner):
            left = self._group_bytes.get(group, 0) - num_bytes
            if left > 0:
                self._group_bytes[group] = left
            else:
                self._group_bytes.pop(group, None)
        left = self._bytes.get(owner, 0) - num_bytes
        if left > 0:
            self._bytes[owner] = left
            return
        self._bytes.pop(owner, None)
        if owner in self._left:
            self._left.discard(owner)
            self._groups.pop(owner, None)

    def stats(self) -> LimitStats:
        timeout_s = float(self.timeout_s) if self.timeout_s is not None else None
        return LimitStats(
            slot_timeout_s=timeout_s,
            max_slot_bytes=self.max_bytes,
            max_user_slot_bytes=self.max_user_bytes,
            max_held_bytes=max(self._bytes.values(), default=0),
            **vars(self.counters),
        )


def _cap(limits: SlotLimits, group: tuple[Hashable, ...]) -> int | None:
    """The cap on what `group` holds: a process's or a user's."""
    return limits.max_bytes if group[0] == PROCESS else limits.max_user_bytes


class Holds:
    """The holds: reservations named `Reserved(ns, key, hold)`, settled together by whoever
    settles the hold. Their entries are `SlotLimits`' reservations; this only names them."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._holds: OrderedDict[str, Hold] = OrderedDict()  # by name, oldest first

    def __len__(self) -> int:
        return len(self._holds)

    def has(self, hold: str, owner: int) -> bool:
        """Whether `owner` has reservations in `hold` (open: not settled, not timed out)."""
        open_hold = self._holds.get(hold)
        return open_hold is not None and any(part.owner == owner for part in open_hold.parts)

    def join(self, hold: str, owner: int, ns: str, keys: list[bytes]) -> None:
        """`owner` has reserved `keys` (each named Reserved(ns, key, hold)) in `hold`."""
        self._holds.setdefault(hold, Hold(self._clock(), [])).parts.append(HoldPart(owner, ns, keys))

    def end(self, hold: str) -> list[HoldPart]:
        """The parts of a hold being settled (none if it is unknown or settled already)."""
        ended = self._holds.pop(hold, None)
        return ended.parts if ended is not None else []

    def expired(self, timeout_s: float, joining: str) -> list[tuple[str, HoldPart]]:
        """End the holds nobody settled within `timeout_s`, but `joining` (a late owner joining
        it now gets slots it will copy into): (name, part) of each part of them."""
        if not self._holds:
            return []
        cutoff, parts = self._clock() - timeout_s, []
        for name in list(itertools.takewhile(lambda n: self._holds[n].began_at <= cutoff, self._holds)):
            if name == joining:
                continue
            log.warning("hold %s was not settled within %.0f s: its entries are not saved", name, timeout_s)
            parts += [(name, part) for part in self._holds.pop(name).parts]
        return parts


class Quarantine(Generic[SlotT]):
    """Entries whose holder may still be copying, kept from reuse until a given time; the store
    decides what each becomes once it is over."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._items: deque[Quarantined[SlotT]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, entries: Iterable[SlotT], leased: bool, seconds: float) -> None:
        until = self._clock() + seconds
        self._items.extend(Quarantined(until, entry, leased) for entry in entries)

    def over(self) -> list[Quarantined[SlotT]]:
        """The quarantines over, oldest first: the store aborts a reserved entry, unpins a leased one."""
        if not self._items:
            return []
        now, over = self._clock(), []
        while self._items and self._items[0].until <= now:
            over.append(self._items.popleft())
        return over
