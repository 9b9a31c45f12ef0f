"""A storage root shared by a cluster of nodes: each node indexes and evicts only the parts of the
key space it owns, so its memory and its metadata operations follow its share, not the cluster.

The pieces: `members` (lease files in `<root>/cluster/members`, liveness by each node's own
monotonic clock, the fence), `parts` (owners by rendezvous hashing over the live members, a
hold-off before evicting in a part gained), `owner_pass` (a node's pass over its parts, every
RESCAN_S or RESCAN_COST_FACTOR times the last pass's duration, and soon after parts become
evictable), `usage` (each owner's usage, the shared capacity, the clear epoch). The capacity
(HPKV_KV_STORAGE_SIZE, one figure for the root) is split by share of the parts: a node evicts in
its parts down to capacity x parts owned / PARTS, so all of them together hold the capacity.

One thread per tier (`run`) ticks the membership every TICK_S: renewals and listings when due,
owners recomputed when the live members change, holds and the fence refreshed, expired leases
reaped by the owner of part 0. The evictor asks `PartLedger.may_evict` before each unlink, so a
node that stalled past its fence unlinks nothing, whatever it had popped.

Primitives: `Cluster` (`join`, `tick`, `pass_once`, `run`, `leave`, `bump_epoch`, `stats`, `ledger`,
`members`, `files`).
Must not know: the tier, how files are read or written, the pool, engines.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..stats import StorageClusterStats, StorageCounters
from .capacity import CapacityPolicy
from .eviction import Evictor
from .index import FileIndex
from .members import MAX_LAG_S, Membership, Timing
from .owner_pass import OwnerPass, PassResult
from .parts import PARTS, PartLedger, hrw_owners
from .paths import EntryPaths
from .usage import ClusterFiles

log = logging.getLogger("hpkv.storage.tier")

TICK_S = 1.0
LEAVE_WAIT_S = 10.0  # a leave waits this long for a pass to end
RESCAN_S = 30.0
RESCAN_COST_FACTOR = 10.0


class Cluster:
    def __init__(
        self,
        index: FileIndex,
        paths: EntryPaths,
        evictor: Evictor,
        capacity: CapacityPolicy,
        counters: StorageCounters,
        timing: Timing,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Installs its ledger in `index` and its check in `evictor`: build it before anything
        is indexed."""
        self._index = index
        self._root = paths.root
        self._capacity = capacity
        self._clock = clock
        self.members = Membership(paths.tree, paths.io, paths.node, timing, clock)
        self.ledger = PartLedger(timing.hold_s, clock)
        self.files = ClusterFiles(paths.tree, paths.io, paths.temp_name)
        self.owner_pass = OwnerPass(
            index, paths, self.ledger, evictor, capacity, self.files, counters, wall_clock, clock
        )
        index.ledger = self.ledger
        evictor.may_unlink = self.ledger.may_evict
        evictor.shared = True  # others write here: a victim's mtime is looked at first
        self._lock = threading.Lock()  # one tick at a time (the thread, a pass's heartbeats, tests)
        self._pass_lock = threading.Lock()  # one pass at a time; never held by a tick
        self._evictable = 0
        self.passes = self.pass_failures = 0
        self.last_pass: tuple[PassResult, float, float] | None = None  # (what it did, its length, its monotonic end)

    def join(self, stop: threading.Event) -> None:
        """Agree on the capacity, take a lease, list the members, own parts (not evictable yet).
        Alone, it lists again MAX_LAG_S later: nodes started together would otherwise each pass
        over every part first (the whole root)."""
        self._capacity.capacity_bytes = self._capacity.sized_bytes = self.files.agree_capacity(
            self._capacity.capacity_bytes
        )
        self.tick()
        if len(self.members.live()) == 1 and not stop.wait(MAX_LAG_S):
            with self._lock:
                try:
                    if self.members.list_now():
                        self._own()
                except OSError:
                    pass  # the next tick lists again

    def tick(self) -> bool:
        """Renew and list when due, own what the view gives; whether parts became evictable (a
        pass is due: it evicts there). Never raises for the file system: said, and the fence
        comes nearer."""
        with self._lock:
            try:
                changed = self.members.tick()
            except OSError as exc:
                log.warning("storage cluster: cannot renew or list the members under %s: %s", self._where(), exc)
                changed = False
            if changed or not self.ledger.owned.any():
                self._own()
            self.ledger.refresh(self.members.evict_until(), self.members.fenced())
            self._capacity.share = self.ledger.share()
            evictable = int(self.ledger.evictable.sum())
            more, self._evictable = evictable > self._evictable, evictable
            if self.ledger.owned[0] and not self.members.fenced():
                for member in self.members.reap():
                    self.files.remove_usage(member)
            return more

    def _own(self) -> None:
        live = list(self.members.live())
        mine = hrw_owners(live) == live.index(self.members.member)
        gained, lost = self.ledger.set_owned(mine, self._index.lock)
        self.owner_pass.forget_parts(lost)
        if len(gained) or len(lost):
            log.info(
                "storage cluster: %d live members; this one (%s) owns %d parts (+%d, -%d)",
                len(live),
                self.members.member,
                int(mine.sum()),
                len(gained),
                len(lost),
            )

    def pass_once(self) -> PassResult:
        """A pass over this node's parts; it ticks as it goes (a pass over many files takes longer
        than a lease: the node must renew meanwhile, or the others take its parts)."""
        with self._pass_lock:
            started = self._clock()
            try:
                result = self.owner_pass.once(self.tick)
                if not self.members.left:
                    self.files.write_usage(self.members.member, self.owner_pass.usage())
            except BaseException:
                self.pass_failures += 1
                raise
            ended = self._clock()
            self.passes += 1
            self.last_pass = (result, ended - started, ended)
            return result

    def run(self, stop: threading.Event) -> None:
        """Ticks and passes until `stop` (see the module docstring). Never raises."""
        wait_s, last = RESCAN_S, self._clock()
        while not stop.wait(TICK_S):
            due = self.tick() or self._clock() - last >= wait_s
            if not due:
                continue
            started = self._clock()
            try:
                self.pass_once()
            except Exception:  # a thread's boundary: the tier goes on, the next pass tries again
                log.exception("storage cluster: the pass over this node's parts under %s failed", self._where())
            last = self._clock()
            wait_s = max(RESCAN_S, RESCAN_COST_FACTOR * (last - started))

    def leave(self) -> None:
        """Stop evicting, remove this node's lease and usage: the others take its parts after their hold."""
        with self._lock:
            self.ledger.refresh(-1.0, fenced=True)
            self.members.leave()
        got = self._pass_lock.acquire(timeout=LEAVE_WAIT_S)  # a pass in progress writes no usage after this
        try:
            self.files.remove_usage(self.members.member)
        finally:
            if got:
                self._pass_lock.release()

    def stats(self) -> StorageClusterStats:
        """This node's view (`hpkv status`, the metrics, `hpkv doctor`): no I/O."""
        members, ledger, counts, now = self.members, self.ledger, self.members.counts, self._clock()
        owned = int(ledger.owned.sum())
        renewed = members.renewed_at()
        last = self.last_pass
        result = last[0] if last is not None else PassResult()
        return StorageClusterStats(
            member=members.member,
            lease_s=members.timing.expire_s,
            live_members=list(members.live()),
            parts=PARTS,
            parts_owned=owned,
            parts_evictable=int(ledger.evictable.sum()),
            fenced=members.fenced(),
            capacity_share_bytes=int(self._capacity.capacity_bytes * owned / PARTS),
            owned_bytes=ledger.owned_bytes,
            owned_files=ledger.owned_files(),
            foreign_files=ledger.foreign_files(),
            renewals=counts.renewals,
            renew_failures=counts.renew_failures,
            lease_remade=counts.lease_remade,
            listings=counts.listings,
            list_failures=counts.list_failures,
            members_expired=counts.expired,
            members_back=counts.back,
            leases_reaped=counts.reaped,
            last_renew_age_s=None if renewed is None else now - renewed,
            passes=self.passes,
            pass_failures=self.pass_failures,
            last_pass_age_s=None if last is None else now - last[2],
            last_pass_s=None if last is None else last[1],
            last_pass_dirs_statted=result.dirs_statted,
            last_pass_dirs_listed=result.dirs_listed,
            last_pass_files_statted=result.files_statted,
            last_pass_added=result.added,
            last_pass_gone=result.gone,
        )

    def bump_epoch(self) -> None:
        try:
            self.files.bump_epoch()
        except OSError as exc:
            log.warning("storage cluster: cannot mark the clear under %s for the other nodes: %s", self._where(), exc)

    def _where(self) -> str:
        return str(self._root)
