"""What differs between the vLLM minors HpkvConnectorV1 serves (0.31 to 0.34), read in one place.

Owns the reading of vLLM objects whose fields moved between minors; each function names the
minors on either side. The tested range itself is `hpkv.integrations.versions.TESTED`.
Primitives: `resumed_req_ids(cached)`, `skips_external_kv(request)`. Must not know what the
connector decides from them.
"""

from __future__ import annotations

from collections.abc import Collection


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
