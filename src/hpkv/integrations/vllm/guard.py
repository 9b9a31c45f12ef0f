"""The scheduler half as vLLM's engine core calls it: a bug degrades to a miss.

Owns `GuardedScheduler`, the scheduler-side entry points of HpkvConnectorV1 wrapped so that an
exception escaping one (a bug here, a vLLM that changed under us), which would stop the engine,
is logged (the first of each kind with its traceback, then at most one a minute) and answered
as a miss: vLLM recomputes what HPKV would have supplied.
Primitives: `HpkvScheduler`, `throttle.Throttle`. Knows nothing of what the scheduler decides.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ...throttle import Throttle
from .metadata import HpkvConnectorMetadata

if TYPE_CHECKING:
    from .scheduler import HpkvScheduler

log = logging.getLogger("hpkv.vllm")

_BUG_LOG_INTERVAL_S = 60.0


class GuardedScheduler:
    def __init__(self, scheduler: HpkvScheduler) -> None:
        self.scheduler = scheduler
        self.bugs = Throttle()  # by entry point

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:
            self._bug("a lookup", lambda: self.scheduler.forget_lookup(request))
            return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        try:
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception:  # vLLM counts those tokens as loaded: the workers must report them failed
            self._bug("a load", lambda: self.scheduler.fail_load(request, blocks, num_external_tokens))

    def hit_sources(self, request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's CacheHitSource -> tokens."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        try:
            sources = self.scheduler.hit_sources(request, num_external_tokens)
            return {CacheHitSource(name): count for name, count in sources.items() if count}
        except Exception:
            self._bug("the hit sources")
            return {}

    def build_connector_meta(self, scheduler_output) -> HpkvConnectorMetadata:
        try:
            return self.scheduler.build_connector_meta(scheduler_output)
        except Exception:
            self._bug("a step's metadata")
            return self.scheduler.bare_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        try:
            self.scheduler.update_connector_output(connector_output)
        except Exception:
            self._bug("a step's output")

    def request_finished(self, request) -> None:
        try:
            self.scheduler.request_finished(request)
        except Exception:  # its leases end with the connection, at the latest
            self._bug("a finished request")

    def reset_cache(self) -> bool:
        try:
            return self.scheduler.reset_cache()
        except Exception:
            self._bug("a cache reset")
            return False

    def take_events(self) -> list:
        feed = self.scheduler.feed
        if feed is None:
            return []
        try:
            return feed.take_events()
        except Exception:  # the events of this step are lost; a consumer sees a gap, not a stopped engine
            self._bug("the KV events")
            return []

    def has_events(self) -> bool:
        feed = self.scheduler.feed
        try:
            return feed is not None and feed.pending()  # attaches the feed at the engine's start
        except Exception:
            self._bug("the KV events")
            return False

    def _bug(self, what: str, *recover) -> None:
        """Called inside an `except`: log the exception (throttled), then run the `recover`
        steps, each as best it can."""
        missed = self.bugs.num_refused(what)
        if self.bugs.allows(time.monotonic(), _BUG_LOG_INTERVAL_S, what):
            log.exception("HPKV bug in %s (%d more since the last report); vLLM recomputes instead", what, missed)
        for step in recover:
            try:
                step()
            except Exception:  # already degrading: the traceback above is the one to read
                log.debug("HPKV could not recover from the bug in %s", what, exc_info=True)
