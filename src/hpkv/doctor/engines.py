"""`hpkv doctor`'s checks of what engines bring: stable block hashes, and namespaces that find
nothing because their settings differ from another's of the same model.

Primitives: `check_hash_seed(env)`, `check_namespaces(stats)`.
Must not know: the pool or storage directories.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ..stats import ServerStats
from .check import Check, Verdict


def check_hash_seed(env: Mapping[str, str]) -> Check:
    # vLLM 0.32 (v1/core/kv_cache_utils.py, resolve_none_hash_seed): PYTHONHASHSEED wins when set;
    # otherwise sha256/sha256_cbor chain from a fixed seed and xxhash/xxhash_cbor from random bytes.
    seed = env.get("PYTHONHASHSEED")
    if seed is None:
        return Check(
            "hash stability",
            Verdict.INFO,
            "PYTHONHASHSEED is not set here: vLLM's default sha256 block hashes are stable across "
            "restarts, but with --prefix-caching-hash-algo xxhash (or xxhash_cbor) they are random per "
            "process and KV saved to storage never hits after a restart",
            "with xxhash, export PYTHONHASHSEED (one fixed value for every engine sharing the storage "
            "directory) before starting the engine; with sha256 nothing is needed",
        )
    return Check(
        "hash stability",
        Verdict.OK,
        f"PYTHONHASHSEED={seed}: vLLM's block hashes are reproducible across restarts with any hash "
        "algorithm (every engine sharing one storage directory needs the same value; changing it "
        "changes every key)",
    )


COLD_LOOKUP_KEYS = 64  # keys a namespace looked up, all missed, before its misses are worth a word


# What makes KV bytes differ, in the words of an engine's settings (the rank is not: ranks of one
# engine have a namespace each by design).
_DESC_FIELDS = {
    "engine": "engine",
    "dtype": "KV dtype",
    "layout": "KV layout",
    "block_size": "block size",
    "num_layers": "layers",
    "entry_bytes": "bytes per block",
    "tp_size": "tensor parallel size",
    "pp_size": "pipeline parallel size",
    "cp_size": "context parallel size",
    "extra": "other settings",
}


def check_namespaces(stats: ServerStats) -> Check:
    """Why lookups find nothing: a namespace that looked up many keys and hit none, beside another
    of the same model whose KV it cannot use (engines with different settings)."""
    name = "namespaces: hits"
    namespaces = {ns: (json.loads(n.desc), n) for ns, n in stats.namespaces.items()}
    if not namespaces:
        return Check(name, Verdict.INFO, "no engine has registered with the server yet")
    cold = [
        ns
        for ns, (_, n) in namespaces.items()
        if n.lookup_keys >= COLD_LOOKUP_KEYS and not n.hit_keys_dram + n.hit_keys_storage
    ]
    mismatches = []
    for ns in cold:
        desc = namespaces[ns][0]
        for other, (other_desc, _) in namespaces.items():
            if other == ns or other_desc["model"] != desc["model"]:
                continue
            fields = _DESC_FIELDS
            if desc.get("pp_size", 1) > 1 and desc.get("pp_size") == other_desc.get("pp_size"):
                # Pipeline stages of one engine: their layers (and so bytes per block) may differ.
                fields = {k: v for k, v in fields.items() if k not in ("num_layers", "entry_bytes")}
            differ = [
                f"{label} {desc.get(key)!r} here, {other_desc.get(key)!r} there"
                for key, label in fields.items()
                if desc.get(key) != other_desc.get(key)
            ]
            if differ:
                mismatches.append(
                    f"namespace {ns[:12]} ({desc['engine']}, {desc['model']}, rank {desc['rank']}) "
                    f"looked up {namespaces[ns][1].lookup_keys} keys and found none, and namespace "
                    f"{other[:12]} of the same model differs in {', '.join(differ)}"
                )
                break
    if mismatches:
        return Check(
            name,
            Verdict.WARN,
            "; ".join(mismatches) + ": KV saved under one cannot serve the other",
            "give every engine serving the model the same settings (those named) to share its KV; HPKV "
            "keeps KV of different settings apart on purpose, since loading it would give wrong tokens",
        )
    lookups = sum(n.lookup_keys for _, n in namespaces.values())
    hits = sum(n.hit_keys_dram + n.hit_keys_storage for _, n in namespaces.values())
    detail = f"{len(namespaces)} namespaces; {hits} of {lookups} keys looked up were found"
    if cold:
        return Check(
            name,
            Verdict.INFO,
            f"{detail}; {len(cold)} namespaces found none yet (prompts not seen "
            "before, or saved only since; an engine's DEBUG log says per request what it loaded and why)",
        )
    return Check(name, Verdict.OK, detail)
