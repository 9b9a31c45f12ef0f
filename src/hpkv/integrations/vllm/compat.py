"""What differs between the vLLM minors HpkvConnectorV1 serves (0.31 to 0.34), read in one place.

Owns the reading of vLLM objects whose fields moved between minors; each function names the
minors on either side. The tested range itself is `hpkv.integrations.versions.TESTED`.
Primitives: `resumed_req_ids(cached)`, `skips_external_kv(request)`, `engine_waker()`. Must not
know what the connector decides from them.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Callable, Collection
from types import FrameType


def resumed_req_ids(cached_request_data) -> Collection[str]:
    """The requests of a step's `CachedRequestData` that resume after a preemption, whose
    `new_block_ids` are then their whole block table (vLLM 0.31-0.33). vLLM 0.34 sends a
    resumed request again in full, among `scheduled_new_reqs`, and dropped the field: none."""
    return getattr(cached_request_data, "resumed_req_ids", None) or ()


def skips_external_kv(request) -> bool:
    """Whether vLLM drops any connector hit for `request` (prompt logprobs, prompt scoring,
    `skip_reading_prefix_cache`): vLLM 0.34's `Request.skip_reading_external_kv`, vLLM
    0.31-0.33's `Request.skip_reading_prefix_cache`."""
    skips = getattr(request, "skip_reading_external_kv", None)
    if skips is None:
        skips = getattr(request, "skip_reading_prefix_cache", False)
    return bool(skips)


def engine_waker() -> Callable[[], None] | None:
    """Wakes vLLM's engine core from another thread so it steps once (and publishes the KV events
    a connector has for it): the engine core's `input_queue` given an `EngineCoreRequestType.WAKEUP`,
    which vLLM's own shutdown uses (vLLM 0.31-0.34: `EngineCoreProc.input_queue`, set before the
    Scheduler and its connector are built, so it is on the stack that builds them). None where
    no engine core process is on the stack (an in-process `LLM`, whose caller steps it)."""
    from vllm.v1.engine import EngineCoreRequestType

    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        inputs = getattr(owner, "input_queue", None) if owner is not None else None
        if isinstance(inputs, queue.Queue):
            return lambda: inputs.put_nowait((EngineCoreRequestType.WAKEUP, None))
        frame = frame.f_back
    return None
