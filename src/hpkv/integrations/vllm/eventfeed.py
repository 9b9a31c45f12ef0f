"""The server's tier journal fed to the scheduler's KV events, within POLL_S of each change.

Only with vLLM's KV events on (`--kv-events-config`); otherwise none of this exists. A thread of
the engine core process, with a connection of its own, asks the server every POLL_S for the
journal records of this engine's namespaces past its cursors (one `Journal` for all of them),
and hands the replies over; when it got any it wakes the engine core (an idle engine would not
step, and vLLM publishes only in a step). On the scheduler's thread, `take_events` (called by
vLLM once per step) applies the replies to `events.TierEvents` in order, or, where records were
lost (the server's bound, or another server), has it learn the tiers again; then returns the
events. So a change in a tier reaches vLLM's publisher within POLL_S plus one engine step.

Primitives: `EventFeed` (`enabled`, `attach`, `saving`, `leased`, `pending`, `take_events`,
`close`), `JournalPoller`. Must not know: what the scheduler loads or saves.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

from ...errors import HpkvError
from ...keys import NamespaceDesc
from ...server import protocol as p
from ...server.client import Client, LeaseHandle
from . import compat
from . import layout as lay
from .events import TierEvents

log = logging.getLogger("hpkv.vllm.events")

POLL_S = 0.1  # the longest a tier's change waits for the poller (documented in docs/vllm.md)
MAX_QUEUED = 64  # replies waiting for the scheduler; past it the poller waits (the server keeps the rest)


def enabled(vllm_config) -> bool:
    """Whether vLLM publishes KV events (`--kv-events-config` with events on and a publisher)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events and config.publisher != "null")


class JournalPoller:
    """The thread that reads the journal: one `Journal` per POLL_S (at once again while the server
    has more), replies queued for the scheduler's thread, the engine woken when any came."""

    def __init__(self, client: Client, cursors: dict[str, int], life: str, wake: Callable[[], None] | None) -> None:
        self.client = client
        self.cursors = dict(cursors)
        self.life = life
        self.replies: deque[p.JournalPages] = deque()
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
            try:
                reply = self.client.journal(list(self.cursors.items()))
            except HpkvError as exc:  # the server is away: asked again next time (another server: lost)
                log.debug("HPKV journal not read: %s", exc)
                continue
            if reply.life != self.life:  # another server: every cursor was into another journal
                self.life = reply.life
                reply.pages = [p.JournalPage(pg.ns, b"", [], pg.last, True, pg.more) for pg in reply.pages]
            for page in reply.pages:
                self.cursors[page.ns] = page.last
            if any(page.keys or page.lost for page in reply.pages):
                self.replies.append(reply)
                if self._wake is not None:
                    self._wake()
            if any(page.more for page in reply.pages):
                wait_s = 0.0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.client.close()


class EventFeed:
    """The scheduler's side: `TierEvents` fed from the poller, on the scheduler's thread."""

    def __init__(self, layouts: Sequence[lay.BlockLayout], num_ranks: int, client: Client) -> None:
        self.client = client  # the scheduler's own: learning the tiers again happens on its thread
        self.events = TierEvents(layouts, num_ranks)
        self.poller: JournalPoller | None = None
        self.life = ""
        self._wake = compat.engine_waker()
        self._stale = False  # learning the tiers again failed: tried again each step

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
        self.poller = JournalPoller(poller_client, self.events.cursors, self.life, self._wake)

    def saving(self, request, start: int, stop: int) -> None:
        if self.poller is not None:
            self.events.saving(request, start, stop)

    def leased(self, request, start: int, leases: Sequence[LeaseHandle], namespaces: Sequence[str]) -> None:
        if self.poller is not None:
            self.events.leased(request, start, leases, namespaces)

    def pending(self) -> bool:
        """Whether replies wait for a step (vLLM then steps an idle engine once more)."""
        return self.poller is not None and bool(self.poller.replies)

    def take_events(self) -> list:
        poller = self.poller
        while poller is not None and poller.replies:
            reply = poller.replies.popleft()
            if reply.life != self.life or any(page.lost for page in reply.pages):
                self._stale = True
            elif not self._stale:
                for page in reply.pages:
                    self.events.apply(page.ns, page.codes, page.keys, page.last)
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
