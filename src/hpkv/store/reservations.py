"""Reservations: slots handed to writers, published by `commit` or by the settle of a hold, or
given back by `abort`; and the taking back of what is held past its limit.

Owns the rules of a reservation: an owner is one writer, and a key it holds reserved already
(listed twice, or again before its commit) gets no second slot; a key reserved in a hold is
the hold's to publish (`settle`), never its owner's; a hold not settled within HOLD_TIMEOUT_S
is aborted whole; what is taken back (at a time limit, or from a client gone while its process
lives) is quarantined first, as its holder may still be copying. The books themselves (who
holds what, the holds, the quarantine) are `SlotLimits`' (`limits.py`), named by `Reserved`.
Primitives: `reserve`, `commit`, `settle`, `abort`, `drop_owner`, `reclaim`.
Must not know: how a write-through runs (`WriteThrough.admit`/`submit` decide), lease contents
beyond their entries. Called without the store's lock, except `reclaim` (caller holds it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from ..limits import Reserved, SlotLimits
from ..pool.dram_tier import DramTier
from ..pool.entry import DramEntry
from ..pool.lru import PrefixOrder
from ..stats import StoreCounters
from ..tiers import HOLD_TIMEOUT_S
from .leases import Leases
from .writethrough import WriteThrough

HOLD_QUARANTINE_S = 30.0  # what is taken back stays unusable this long: a copy into it may go on


class Reservations:
    def __init__(
        self,
        lock: threading.Lock,
        dram: DramTier,
        held: SlotLimits[DramEntry],
        counters: StoreCounters,
        leases: Leases,
        writes: WriteThrough | None,
        order: PrefixOrder,
    ) -> None:
        self._lock = lock
        self._dram = dram
        self._held = held
        self._counters = counters
        self._writes = writes  # None: no storage tier, nothing is written through
        self._order = order
        self._leases = leases  # whose expired leases `reclaim` takes back

    def reserve(self, ns: str, keys: Sequence[bytes], owner: int = 0, hold: str = "") -> list[int | None]:
        """Slots to copy each key's bytes into; None where the key is present (nothing is saved
        twice), the owner holds it reserved already (even if a clear dropped the entry since: it
        may still be copying into the first slot), the owner is at its cap, or the pool has no
        slot that is not pinned. With `hold`, the keys join that hold."""
        offsets: list[int | None] = []
        with self._lock:
            self.reclaim(hold)
            room, slot_bytes, num_capped = self._held.room(owner), self._dram.slot_bytes(ns), 0
            for key in keys:
                name = Reserved(ns, key, hold)
                entry: DramEntry | None
                if self._held.has(owner, name):
                    entry = None
                elif room < slot_bytes:
                    entry, num_capped = None, num_capped + 1
                else:
                    entry = self._dram.reserve(ns, key)
                if entry is None:
                    self._counters.skipped_present += 1
                    offsets.append(None)
                    continue
                self._held.add(owner, name, entry)
                room -= slot_bytes
                offsets.append(entry.offset)
            if hold:
                reserved = [key for key, offset in zip(keys, offsets, strict=True) if offset is not None]
                if reserved:
                    self._held.holds.join(hold, owner, ns, reserved)
            self._held.refused(owner, num_capped, "reserved")
        return offsets

    def commit(self, ns: str, keys: Sequence[bytes], owner: int = 0) -> int:
        """Publish keys `owner` reserved (not in a hold; others are ignored) and queue their
        write-through; the number published."""
        with self._lock:
            num, writes = self._publish([self._held.pop(owner, Reserved(ns, key)) for key in keys])
        self._submit(writes)
        return num

    def settle(self, hold: str, abort: Iterable[bytes] | None) -> tuple[int, int]:
        """End a hold: commit every owner's reservations in it but the keys in `abort` (all of
        them when `abort` is None), which are aborted. Returns (published, aborted); reservations
        whose owner is gone meanwhile were aborted already and count in neither. Settling a hold
        that does not exist (settled already, or nothing was reserved in it) does nothing."""
        bad = None if abort is None else set(abort)
        num_published = num_aborted = 0
        writes: list[DramEntry] = []
        with self._lock:
            for part in self._held.holds.end(hold):
                good = []
                for key in part.keys:
                    entry = self._held.pop(part.owner, Reserved(part.ns, key, hold))
                    if entry is not None and (bad is None or key in bad):
                        self._dram.abort(entry)
                        num_aborted += 1
                    else:
                        good.append(entry)
                num, more = self._publish(good)
                num_published += num
                writes += more
            self._counters.aborts += num_aborted
        self._submit(writes)
        return num_published, num_aborted

    def abort(self, ns: str, keys: Sequence[bytes], owner: int = 0, hold: str = "") -> int:
        """Give back the slots of keys `owner` reserved (in `hold`, with one: an owner may give
        back what it reserved in a hold, never commit it); returns how many it held."""
        num = 0
        with self._lock:
            for key in keys:
                entry = self._held.pop(owner, Reserved(ns, key, hold))
                if entry is not None:
                    self._dram.abort(entry)
                    num += 1
            self._counters.aborts += num
        return num

    def drop_owner(self, owner: int, quarantine_s: float) -> None:
        """Abort the reservations of an owner that is gone (quarantined first, with
        `quarantine_s`). Caller holds the lock."""
        reserved = self._held.pop_owner(owner)
        if quarantine_s > 0:
            self._held.quarantined.add(reserved, False, quarantine_s)
        else:
            for entry in reserved:
                self._dram.abort(entry)
        self._counters.aborts += len(reserved)

    def _publish(self, entries: list[DramEntry | None]) -> tuple[int, list[DramEntry]]:
        """Commit reserved entries (in prefix order, published in the policy's; None skipped):
        the number published (not dropped meanwhile) and the write-throughs to submit once the
        lock is let go. Caller holds the lock."""
        published, writes = 0, []
        for entry in self._order.arrange(entries):
            if entry is not None and self._dram.commit(entry):
                published += 1
                if self._writes is not None and self._writes.admit(entry):
                    writes.append(entry)
        self._counters.commits += published
        return published, writes

    def _submit(self, writes: list[DramEntry]) -> None:
        if self._writes is not None and writes:
            self._writes.submit(writes)

    def reclaim(self, joining: str = "") -> None:
        """Take back holds nobody settled within HOLD_TIMEOUT_S (but `joining`), reservations and
        leases past the clients' limit: quarantined first, as their holder may still be copying
        (a stalled process); and end the quarantines that are over. Caller holds the lock."""
        held = self._held
        expired = [
            entry
            for name, part in held.holds.expired(HOLD_TIMEOUT_S, joining)
            for key in part.keys
            if (entry := held.pop(part.owner, Reserved(part.ns, key, name))) is not None
        ]
        expired += [entry for _, _, entry in held.expired_reservations()]
        held.quarantined.add(expired, False, HOLD_QUARANTINE_S)
        self._counters.aborts += len(expired)
        for lease in self._leases.take_expired():
            held.quarantined.add(self._order.arrange(lease.entries), True, HOLD_QUARANTINE_S)  # as `release` unpins
        for item in held.quarantined.over():
            if item.leased:
                self._dram.unpin(item.entry)
            else:
                self._dram.abort(item.entry)
