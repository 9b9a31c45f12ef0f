"""Membership of the nodes sharing one storage root: lease files in the root, liveness judged by
each observer's own monotonic clock.

`<root>/cluster/members/` holds one lease file per running tier, named `<member>.<seq>`:
`<member>` is the node's name and a random incarnation drawn at start (a restarted server is a
new member; two nodes with one host name stay apart). The tier renews it every `renew_s` by
renaming it to `<member>.<seq+1>` (one metadata operation), and lists the directory every
`renew_s` (one listing of N names; a member's highest seq counts, as a listing may show a renamed
lease under both names for a moment). A member is live, in an observer's view, while the observer
has seen its name change within `expire_s` of its own monotonic clock, or first saw it less than
`expire_s` ago. Nothing compares clocks across nodes: wall clocks that disagree or jump do not
matter, only each node's monotonic rate. A member expired stays dead in the view until its lease
changes again (a stall ended; it fenced itself meanwhile, see below).

The fence: a node whose last successful renewal started `expire_s` ago, or whose last successful
listing started `fresh_s` ago, must not evict (`evict_until`): the others may have declared it
dead and taken its parts. Its lease renamed away under it (reaped as dead) is made again.

A tier that stops removes its lease (`leave`); leases expired for `expire_s + hold_s` are removed
by a live member (`reap`; the one that owns part 0, so one at a time).

Primitives: `Timing`, `Membership` (`tick`, `list_now`, `live`, `evict_until`, `fenced`, `reap`, `leave`,
`member`, `dir_fd`, `renewed_at`, `counts`: `MemberCounts`, what `hpkv status` shows).
Must not know: parts, the index, capacity, eviction.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import tree
from .fileio import FileIO

log = logging.getLogger("hpkv.storage.tier")

CLUSTER_DIR = "cluster"
MEMBERS_DIR = "members"
MAX_LAG_S = 2.0  # how late a listing or an attribute may show a change (the tested file systems: ~1 s)
BATCH_S = 1.0  # an eviction checks ownership again at least this often (before each unlink)


@dataclass(frozen=True)
class Timing:
    """The protocol's times, all from the lease (`expire_s`, HPKV_KV_STORAGE_LEASE)."""

    expire_s: float = 30.0

    @property
    def renew_s(self) -> float:
        return self.expire_s / 3

    @property
    def fresh_s(self) -> float:
        return self.expire_s / 2

    @property
    def hold_s(self) -> float:
        """Before a node evicts in a part it gained: the previous owner has listed the members by
        then (every `fresh_s` at most, each listing late by MAX_LAG_S at most) and stopped."""
        return self.fresh_s + MAX_LAG_S + BATCH_S + 2.0

    @property
    def takeover_s(self) -> float:
        """A member killed: its parts evictable by others within this (listing lag, its last
        renewal and the observer's listing period, the expiry, the hold)."""
        return MAX_LAG_S + 2 * self.renew_s + self.expire_s + self.hold_s


@dataclass
class MemberCounts:
    """What this node's membership did and saw since it joined (`hpkv status`, the metrics)."""

    renewals: int = 0
    renew_failures: int = 0
    lease_remade: int = 0  # its lease found gone (reaped as dead while it stalled) and made again
    listings: int = 0
    list_failures: int = 0
    expired: int = 0  # members seen silent past the lease
    back: int = 0  # expired members seen renewing again
    reaped: int = 0  # expired members' leases removed


class Membership:
    def __init__(
        self,
        root: tree.Root,
        io: FileIO,
        node: str,
        timing: Timing,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._root = root
        self._io = io
        self.timing = timing
        self._clock = clock
        self.member = f"{node.replace('.', '_')}-{secrets.token_hex(4)}"
        self._seq = 0
        self._fd: int | None = None
        self._last_renew = -math.inf  # monotonic starts of the last successful renewal and listing
        self._last_list = -math.inf
        self._seen: dict[str, tuple[int, float]] = {}  # member -> (seq seen, local time it changed)
        self._dropped: dict[str, tuple[int, float]] = {}  # expired in this view -> (seq, local time)
        self._listed: dict[str, int] = {}
        self._live: tuple[str, ...] = ()
        self.left = False
        self.counts = MemberCounts()

    def dir_fd(self) -> int:
        """`<root>/cluster/members`, made where missing, held open."""
        if self._fd is None:
            self._fd = tree.open_below(self._root.fd(), self._root.path, [CLUSTER_DIR, MEMBERS_DIR], create=True)
        return self._fd

    def _reopen(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def tick(self) -> bool:
        """Renew and list when due; whether the live members changed. OSErrors are the caller's
        to say: a renewal or listing that fails leaves its time behind (the fence comes nearer)."""
        before = self._live
        now = self._clock()
        if self.left:
            return False
        if now - self._last_renew >= self.timing.renew_s:
            self._renew(now)
        if now - self._last_list >= self.timing.renew_s:
            self._list(now)
        return self._live != before

    def list_now(self) -> bool:
        """List the members now, due or not; whether the live members changed."""
        before = self._live
        self._list(self._clock())
        return self._live != before

    def _renew(self, now: float) -> None:
        old, new = f"{self.member}.{self._seq}", f"{self.member}.{self._seq + 1}"
        try:
            fd = self.dir_fd()
            try:
                if self._seq == 0:
                    raise FileNotFoundError(errno.ENOENT, "no lease yet")
                self._io.rename(old, new, dir_fd=fd)
            except FileNotFoundError:  # the first, or reaped as dead while this node stalled
                try:
                    os.close(os.open(new, tree.CREATE_FLAGS, 0o600, dir_fd=fd))
                except FileExistsError:
                    pass
                self.counts.lease_remade += self._seq > 0
        except OSError as exc:
            self.counts.renew_failures += 1
            if exc.errno == errno.ESTALE:
                self._reopen()
            raise
        self._seq += 1
        self._last_renew = now
        self.counts.renewals += 1

    def _list(self, now: float) -> None:
        try:
            entries = self._io.list_dir(self.dir_fd())
        except OSError as exc:
            self.counts.list_failures += 1
            if exc.errno in (errno.ESTALE, errno.ENOENT):
                self._reopen()
            raise
        listed: dict[str, int] = {}
        for entry in entries:
            member, _, seq = entry.name.rpartition(".")
            if member and seq.isdigit():
                listed[member] = max(listed.get(member, 0), int(seq))
        self._listed = listed
        self._observe(listed, now)
        self._last_list = now
        self.counts.listings += 1

    def _observe(self, listed: dict[str, int], now: float) -> None:
        """The view from one listing (see the module docstring)."""
        seen, dropped = self._seen, self._dropped
        for member, seq in listed.items():
            if member in dropped:
                if dropped[member][0] == seq:
                    continue  # the lease it expired, unchanged: still dead
                del dropped[member]  # renewed since: back (a stall ended, and it fenced itself)
                self.counts.back += 1
            if seen.get(member, (None,))[0] != seq:
                seen[member] = (seq, now)
        for member in [m for m in seen if m not in listed and m != self.member]:
            del seen[member]  # its lease removed: it left
        for member in [m for m in dropped if m not in listed]:
            del dropped[member]
        for member, (seq, since) in list(seen.items()):
            if now - since > self.timing.expire_s and member != self.member:
                dropped[member] = (seq, now)
                del seen[member]
                self.counts.expired += 1
                log.info("storage cluster: member %s silent for %.0f s, its parts go to others", member, now - since)
        seen[self.member] = (self._seq, now)
        self._live = tuple(sorted(seen))

    def live(self) -> tuple[str, ...]:
        """The live members in this node's view, sorted (this one among them once it listed)."""
        return self._live or (self.member,)

    def evict_until(self) -> float:
        """The monotonic time from which this node is fenced unless it renews and lists again."""
        return min(self._last_renew + self.timing.expire_s, self._last_list + self.timing.fresh_s)

    def renewed_at(self) -> float | None:
        """The monotonic start of the last successful renewal; None: none yet."""
        return None if self._last_renew == -math.inf else self._last_renew

    def fenced(self) -> bool:
        return self._clock() >= self.evict_until()

    def reap(self) -> list[str]:
        """Remove the leases of members expired in this view for `hold_s` and unchanged since;
        the members reaped (their usage files go too, the caller's)."""
        now, gone = self._clock(), []
        for member, (seq, since) in list(self._dropped.items()):
            if now - since >= self.timing.hold_s and self._listed.get(member) == seq:
                try:
                    self._io.unlink(f"{member}.{seq}", dir_fd=self.dir_fd())
                except OSError:
                    continue
                gone.append(member)
        self.counts.reaped += len(gone)
        return gone

    def leave(self) -> None:
        """Remove this node's lease (a graceful leave: it evicts no more, nor renews)."""
        self.left = True
        if self._seq:
            try:
                self._io.unlink(f"{self.member}.{self._seq}", dir_fd=self.dir_fd())
            except OSError:
                pass
        self._reopen()
