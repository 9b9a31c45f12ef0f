"""The model part of a vLLM namespace: which weights computed the KV, and what in the engine's
config changes the KV bytes on top of them.

`model_identity` is the weights: HPKV_MODEL_ID where the operator sets it, else the content
fingerprint of the model directory (`hpkv.identity`; the path never enters it). Weights HPKV
cannot fingerprint (random `--load-format dummy` weights, a loader that reads them from elsewhere,
a hub id with no local snapshot) get a private identity: this engine instance's own namespace
(vLLM's `instance_id`, which its scheduler and workers share), never shared and never served to
a later engine. `model_text` adds what changes the numerics on load, which neither the weights
nor vLLM's block hashes cover: online quantization, config overrides, another config directory,
another model class, sliding window disabled, layers kept out of KV quantization, a draft model.

The scheduler half computes it on a thread of its own (`identity_task`: the connector is built
once the workers have read the weights, so they are in the page cache), and serves no KV from
HPKV and saves none until it is known; the workers learn it from the scheduler's metadata.

Primitives: `model_identity(vllm_config, override)`, `identity_task(vllm_config, override)`,
`model_text(vllm_config, identity)`, `warn_if_hashes_unstable` (vLLM block hashes that change
with every process).
Must not know: pools, clients, layouts.
"""

from __future__ import annotations

import json
import logging
import os
import uuid

from ...identity import (
    IdentityTask,
    ModelIdentity,
    NoContentIdentity,
    content_identity,
    loader_identity,
    unreadable_identity,
)
from ...identity import model_text as identity_text

log = logging.getLogger("hpkv.vllm.scheduler")

# Loaders that read the weights from the model directory (or hub snapshot) as given.
LOCAL_LOAD_FORMATS = frozenset(
    (
        "auto",
        "hf",
        "safetensors",
        "pt",
        "npcache",
        "fastsafetensors",
        "instanttensor",
        "mistral",
        "sharded_state",
        "runai_streamer",
        "runai_streamer_sharded",
        "gguf",
        "bitsandbytes",
    )
)
_PROCESS_SCOPE = uuid.uuid4().hex[:12]  # a vLLM without instance_id: private to this process
START_WAIT_S = 1.0  # how long the scheduler half waits for the identity before vLLM serves without it


def model_identity(vllm_config, override: str | None) -> ModelIdentity:
    """The identity of the weights this engine serves (see the module docstring). Reads every
    byte of files not seen before: call it off the engine's critical path (`identity_task`)."""
    model = vllm_config.model_config
    load = vllm_config.load_config
    scope = f"vllm-{getattr(vllm_config, 'instance_id', '') or _PROCESS_SCOPE}"
    load_format = str(getattr(load.load_format, "value", load.load_format))
    identity = loader_identity(load_format, LOCAL_LOAD_FORMATS, override, scope)
    if identity is not None and not identity.shared:
        return identity
    if identity is None and getattr(model, "model_weights", None):
        return unreadable_identity(
            "weights from object storage", scope, f"the weights stream from {model.model_weights}"
        )
    try:
        if identity is None:
            identity = content_identity(model.model, model.revision, load.download_dir)
            if not identity.num_weight_files:
                raise NoContentIdentity(f"{model.model} holds no weight file")
        # Also under HPKV_MODEL_ID: it names the weights, not the draft model or another config.
        for what, other, revision in _other_models(vllm_config):
            identity = identity.with_part(what, content_identity(other, revision, load.download_dir))
    except NoContentIdentity as exc:
        return unreadable_identity("weights not readable here", scope, str(exc))
    return identity


def identity_task(vllm_config, override: str | None) -> IdentityTask:
    """`model_identity` on a thread of its own, waited for START_WAIT_S: a model whose files are
    remembered (or small) starts with HPKV on; a first start of large weights goes on without."""
    scope = f"vllm-{getattr(vllm_config, 'instance_id', '') or _PROCESS_SCOPE}"
    task = IdentityTask(lambda: model_identity(vllm_config, override), scope)
    task.wait(START_WAIT_S)
    return task


def _other_models(vllm_config) -> list[tuple[str, str, str | None]]:
    """Other directories whose content shapes this engine's KV: a config read from elsewhere
    (--hf-config-path), a draft model whose layers may share the KV cache group."""
    model = vllm_config.model_config
    out = []
    config_path = getattr(model, "hf_config_path", None)
    if config_path and config_path != model.model:
        out.append(("hf_config", config_path, model.revision))
    draft = getattr(getattr(vllm_config, "speculative_config", None), "draft_model_config", None)
    if draft is not None and getattr(draft, "model", None) and draft.model != model.model:
        out.append(("draft", draft.model, getattr(draft, "revision", None)))
    return out


def model_text(vllm_config, identity: ModelIdentity) -> str:
    """The namespace's model field: the identity, plus what changes the numerics on load, each
    part escaped (`identity.model_text`)."""
    model = vllm_config.model_config
    parts: list[tuple[str, str]] = []
    # Online only: a pre-quantized checkpoint says so in its config.json (in the identity); vLLM
    # may pick another kernel for it per GPU (awq, awq_marlin), which must not split the namespace.
    prequantized = getattr(getattr(model, "hf_config", None), "quantization_config", None)
    if getattr(model, "quantization", None) and not prequantized:
        parts.append(("quantization", str(model.quantization)))
        quant_config = getattr(model, "quantization_config", None)
        if quant_config:
            parts.append(("quantization_config", _json(quant_config)))
    overrides = getattr(model, "hf_overrides", None)
    if overrides and not callable(overrides):
        parts.append(("hf_overrides", _json(overrides)))
    elif callable(overrides):  # a function: its effect is unknown; its name at least
        parts.append(("hf_overrides", getattr(overrides, "__qualname__", type(overrides).__name__)))
    if getattr(model, "model_class_overrides", None):
        parts.append(("model_class_overrides", _json(model.model_class_overrides)))
    if getattr(model, "disable_sliding_window", False):
        parts.append(("disable_sliding_window", ""))
    skip = getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None)
    if skip and vllm_config.cache_config.cache_dtype != "auto":
        parts.append(("kv_cache_dtype_skip_layers", ",".join(sorted(map(str, skip)))))
    return identity_text(identity.id, parts)


def _json(value) -> str:
    if hasattr(value, "__dict__") and not isinstance(value, dict):
        value = vars(value)
    return json.dumps(value, sort_keys=True, default=str)


def warn_if_hashes_unstable(vllm_config) -> None:
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    if algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
        log.warning(
            "--prefix-caching-hash-algo %s without PYTHONHASHSEED makes vLLM's block hashes random per "
            "process: KV saved by HPKV will never hit after a restart or from another engine. Fix: "
            "export PYTHONHASHSEED=<one value for every engine> or use sha256",
            algo,
        )
