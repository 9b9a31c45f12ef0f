"""The server's tier journal fed to the scheduler's KV events, within POLL_S of each change.

Only with vLLM's KV events on (`--kv-events-config`); otherwise none of this exists. A thread of
the engine core process, with a connection of its own, asks the server every POLL_S for the
journal records of this engine's namespaces past its cursors (one `Journal` for all of them),
giving it on the same call the block descriptions made since (`TierEvents.outbox`, at most
DESCRIBE_BATCH a call), and hands the replies over; when it got any it wakes the engine core (an
idle engine would not step, and vLLM publishes only in a step). On the scheduler's thread,
`take_events` (called by vLLM once per step) applies the replies to `events.TierEvents` in
order, or, where records were lost (the server's bound, or another server), has it learn the
tiers again; then returns the events. So a change in a tier reaches vLLM's publisher within
POLL_S plus one engine step.

The feed attaches at the engine's first idle check or step once the model's identity is known
(`start`: it registers the namespaces), not at its first request; the poller's first calls page
through the descriptions the server kept of this engine's namespaces (`Journal.snapshot`, with
the tiers holding each), adopted in order with the records: what the tiers held before this
engine started is announced within POLL_S plus one engine step of its start.

Primitives: `EventFeed` (`enabled`, `attach`, `saving`, `leased`, `pending`, `take_events`,
`close`), `JournalPoller`. Must not know: what the scheduler loads or saves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from ...errors import HpkvError
from ...identity import IdentityTask
from ...keys import NamespaceDesc
from ...server import protocol as p
from ...server.client import Client, LeaseHandle, ServerError
from . import compat
from . import layout as lay
from .events import TierEvents

log = logging.getLogger("hpkv.vllm.events")

POLL_S = 0.1  # the longest a tier's change waits for the poller (documented in docs/vllm.md)
MAX_QUEUED = 64  # replies waiting for the scheduler; past it the poller waits (the server keeps the rest)
DESCRIBE_BATCH = 1 << 12  # descriptions given per `Journal` (about 0.5 MiB at 16 tokens a block)
DESCRIBE_BATCH_BYTES = 4 << 20  # and their bytes at most: a request stays well within a frame
START_RETRY_S = 1.0  # between tries to attach while the server cannot be reached


def enabled(vllm_config) -> bool:
    """Whether vLLM publishes KV events (`--kv-events-config` with events on and a publisher)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events and config.publisher != "null")


class JournalPoller:
    """The thread that reads the journal: one `Journal` per POLL_S (at once again while the server
    has more), replies queued for the scheduler's thread, the engine woken when any came."""

    def __init__(
        self,
        client: Client,
        cursors: dict[str, int],
        life: str,
        wake: Callable[[], None] | None,
        outbox: deque[tuple[str, bytes, bytes]] | None = None,
        snapshots: Sequence[p.Snapshot] = (),
    ) -> None:
        self.client = client
        self.cursors = dict(cursors)
        self.life = life
        self.replies: deque[p.JournalPages] = deque()
        self.outbox: deque[tuple[str, bytes, bytes]] = outbox if outbox is not None else deque()
        self.snapshots = list(snapshots)  # those still to page through, each from its `after`
        self._unsent: list[p.Described] = []  # given again until the server has them
        self._wake = wake
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpkv-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        wait_s = POLL_S
        while not self._stop.wait(wait_s):
            wait_s = POLL_S
            if len(self.replies) >= MAX_QUEUED:  # the scheduler is behind; the server keeps the records
                continue
            describe = self._unsent or self._described()
            snapshots = self._next_snapshots()
            try:
                reply = self.client.journal(list(self.cursors.items()), describe=describe, snapshot=snapshots)
            except HpkvError as exc:  # the server is away: asked again next time (another server: lost)
                log.debug("HPKV journal not read: %s", exc)
                refused = isinstance(exc, ServerError) and exc.code == "bad_request"
                self._unsent = [] if refused else describe  # never refused by a server of our version
                continue
            self._unsent = []
            if reply.life != self.life:  # another server: every cursor was into another journal
                self.life = reply.life
                reply.pages = [p.JournalPage(pg.ns, b"", [], pg.last, True, pg.more) for pg in reply.pages]
                reply.snapshot, self.snapshots = [], []  # its DRAM pool and descriptions are new
            self._paged(snapshots, reply.snapshot)
            for page in reply.pages:
                self.cursors[page.ns] = page.last
            if any(page.keys or page.lost for page in reply.pages) or any(s.keys for s in reply.snapshot):
                self.replies.append(reply)
                if self._wake is not None:
                    self._wake()
            if any(page.more for page in reply.pages) or self.snapshots:
                wait_s = 0.0

    def _described(self) -> list[p.Described]:
        """Up to DESCRIBE_BATCH descriptions (DESCRIBE_BATCH_BYTES) from the outbox, by namespace."""
        by_ns: dict[str, p.Described] = {}
        num_bytes = 0
        for _ in range(min(DESCRIBE_BATCH, len(self.outbox))):
            num_bytes += len(self.outbox[0][1]) + len(self.outbox[0][2])
            if num_bytes > DESCRIBE_BATCH_BYTES:
                break
            ns, key, blob = self.outbox.popleft()
            described = by_ns.setdefault(ns, p.Described(ns, [], []))
            described.keys.append(key)
            described.blobs.append(blob)
        return list(by_ns.values())

    def _next_snapshots(self) -> list[p.Snapshot]:
        """The snapshots to ask next, within the protocol's bounds per request."""
        asked: list[p.Snapshot] = []
        num_held_in = 0
        for snapshot in self.snapshots[: p.MAX_SNAPSHOTS]:
            num_held_in += len(snapshot.held_in)
            if asked and num_held_in > p.MAX_SNAPSHOT_NAMESPACES:
                break
            asked.append(snapshot)
        return asked

    def _paged(self, asked: list[p.Snapshot], pages: list[p.SnapshotPage]) -> None:
        """Snapshots read on from where their pages ended; those read to their end done."""
        for snapshot, page in zip(asked, pages):
            snapshot.after = page.last
            if not page.more:
                self.snapshots.remove(snapshot)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.client.close()


class EventFeed:
    """The scheduler's side: `TierEvents` fed from the poller, on the scheduler's thread."""

    def __init__(
        self,
        layouts: Sequence[lay.BlockLayout],
        num_ranks: int,
        client: Client,
        start: Callable[[], object] = lambda: None,
        identity: IdentityTask | None = None,
    ) -> None:
        self.client = client  # the scheduler's own: learning the tiers again happens on its thread
        self.events = TierEvents(layouts, num_ranks)
        self.poller: JournalPoller | None = None
        self.life = ""
        self._wake = compat.engine_waker()
        self._stale = False  # learning the tiers again failed: tried again each step
        self._start = start  # the scheduler's: registers its namespaces (once the identity is known), then `attach`
        self._next_start = 0.0
        if identity is not None and identity.get() is None and self._wake is not None:
            wake = self._wake  # once the identity is known, an idle engine checks again (and attaches)
            threading.Thread(target=lambda: (identity.wait(), wake()), name="hpkv-events-start", daemon=True).start()

    def attach(self, namespaces: Sequence[str], descs: Sequence[NamespaceDesc]) -> None:
        """Watch this engine's namespaces from now (before any lease answer is read), then start
        the poller from there."""
        self.events.attach(namespaces)
        watched = self.client.journal([(ns, -1) for ns in namespaces])
        self.life = watched.life
        for page in watched.pages:
            self.events.cursors[page.ns] = page.last
        # Never starts a server: the engine's other clients do, and this one follows.
        trusted = self.client.trusted_uids
        poller_client = Client(self.client.directory, "vllm-events", autostart=False, trusted_uids=trusted)
        for desc in descs:  # registered on its connection too: a restarted server learns them again from it
            poller_client.register(desc)
        self.poller = JournalPoller(
            poller_client, self.events.cursors, self.life, self._wake, self.events.outbox, self.events.snapshots()
        )

    def saving(self, request, start: int, stop: int) -> None:
        if self.poller is not None:
            self.events.saving(request, start, stop)

    def leased(self, request, start: int, leases: Sequence[LeaseHandle], namespaces: Sequence[str]) -> None:
        if self.poller is not None:
            self.events.leased(request, start, leases, namespaces)

    def pending(self) -> bool:
        """Whether replies wait for a step (vLLM then steps an idle engine once more)."""
        self._attached()
        return self.poller is not None and bool(self.poller.replies)

    def _attached(self) -> bool:
        """Attach now if not yet (the engine's first checks, not its first request: what the tiers
        held before it started is announced without one); past a failure, tried again after
        START_RETRY_S (a check must not wait on an absent server each time)."""
        if self.poller is None and time.monotonic() >= self._next_start:
            try:
                self._start()
            except HpkvError as exc:
                self._next_start = time.monotonic() + START_RETRY_S
                log.debug("HPKV KV events not attached yet: %s", exc)
        return self.poller is not None

    def take_events(self) -> list:
        self._attached()
        poller = self.poller
        while poller is not None and poller.replies:
            reply = poller.replies.popleft()
            if reply.life != self.life or any(page.lost for page in reply.pages):
                self._stale = True
            elif not self._stale:
                for page in reply.pages:
                    self.events.apply(page.ns, page.codes, page.keys, page.last)
            for snapshot in reply.snapshot:  # after the records it was read past (then a resync asks again)
                self.events.adopt(snapshot)
        if self._stale:  # records lost: what the tiers hold now, then the records past it
            try:
                self.life = self.events.resync(self.client)
                self._stale = False
            except HpkvError as exc:
                log.warning("HPKV could not learn its tiers again for KV events (tried again next step): %s", exc)
        return self.events.take()

    def close(self) -> None:
        if self.poller is not None:
            self.poller.close()
