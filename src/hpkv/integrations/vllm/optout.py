"""Per-request opt-out: a request's `kv_transfer_params` may keep it out of HPKV.

`{"hpkv_load": false}`: HPKV supplies none of its KV (vLLM computes it, or takes its own device
prefix cache); `{"hpkv_save": false}`: none of its KV is saved to HPKV (DRAM or storage); both:
neither. Absent keys mean true. A value that is not a boolean (or "true"/"false", "1"/"0") is
taken as false, the side that keeps the request's KV out, and said once in the log.

Primitives: `may_load(request)`, `may_save(request)`. Must not know: the server, the pool.
"""

from __future__ import annotations

import logging

log = logging.getLogger("hpkv.vllm")

LOAD, SAVE = "hpkv_load", "hpkv_save"
_WORDS = {"true": True, "1": True, "false": False, "0": False}
_said: set[str] = set()


def may_load(request) -> bool:
    return _allowed(request, LOAD)


def may_save(request) -> bool:
    return _allowed(request, SAVE)


def _allowed(request, name: str) -> bool:
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or name not in params:
        return True
    value = params[name]
    if isinstance(value, bool):
        return value
    word = _WORDS.get(str(value).strip().lower()) if isinstance(value, str | int) else None
    if word is None:
        if name not in _said:
            _said.add(name)
            log.warning(
                "kv_transfer_params %s=%r is not true or false: taken as false (the request is kept out); "
                'send {"%s": false} or true',
                name,
                value,
                name,
            )
        return False
    return word
