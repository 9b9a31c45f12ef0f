"""The model part of an SGLang namespace: which weights computed the KV, and what in SGLang's
server arguments changes the KV bytes on top of them.

`model_identity` is the weights: HPKV_MODEL_ID where the operator sets it, else the content
fingerprint of `--model-path` (`hpkv.identity`; the path never enters it), plus the content of
every adapter given by `--lora-paths`: SGLang keys a LoRA request's pages by a stable id made
of the adapter's name and path only, so an adapter changed at its path would otherwise be
served the old one's KV. (Adapters loaded at run time get a random id per load from SGLang:
never shared.) Weights HPKV cannot fingerprint (random `--load-format dummy` weights, a loader
that reads them from elsewhere, a hub id with no local snapshot) get a private identity, this
process's own: never shared, never served to a later engine. `model_text` adds what changes the
numerics on load.

Primitives: `model_identity(args, override)`, `model_text(args, identity)`.
Must not know: pools, clients, page layouts.
"""

from __future__ import annotations

import json
import os
import socket
import uuid

from ...identity import ModelIdentity, NoContentIdentity, content_identity, loader_identity, unreadable_identity
from ...identity import model_text as identity_text

# Loaders that read the weights from --model-path (or its hub snapshot) as given.
LOCAL_LOAD_FORMATS = frozenset(
    (
        "auto",
        "pt",
        "safetensors",
        "instanttensor",
        "npcache",
        "sharded_state",
        "presharded",
        "gguf",
        "bitsandbytes",
        "mistral",
        "layered",
        "fastsafetensors",
        "runai_streamer",
    )
)
# Server arguments that change a model's numerics on load, with the values that change nothing.
NUMERICS_ARGS = (("quantization", None), ("modelopt_quant", None), ("dtype", "auto"), ("qsa_indexer_dtype", "auto"))
# Server arguments that take weights or config from outside --model-path.
OUTSIDE_ARGS = ("modelopt_checkpoint_restore_path", "custom_weight_loader", "decrypted_config_file", "rl_quant_profile")


def launch_scope() -> str:
    """What the TP ranks of one SGLang launch share, and no other launch has: the launching
    process (their parent) and its start time (pids are reused). An MLA model's ranks read the
    namespace rank 0 writes, so a private identity per rank process would never hit."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/stat", encoding="ascii") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22, starttime
    except (OSError, IndexError):
        return uuid.uuid4().hex[:12]
    return f"{socket.gethostname()}-{ppid}-{started}"


_PROCESS_SCOPE = launch_scope()
START_WAIT_S = 1.0  # how long registration waits for the identity before SGLang serves without it


def model_identity(args, override: str | None) -> ModelIdentity:
    """The identity of the weights this engine serves (see the module docstring)."""
    scope = f"sglang-{_PROCESS_SCOPE}"
    load_format = str(getattr(getattr(args, "load_format", "auto"), "value", getattr(args, "load_format", "auto")))
    identity = loader_identity(load_format, LOCAL_LOAD_FORMATS, override, scope)
    if identity is not None and not identity.shared:
        return identity
    outside = [name for name in OUTSIDE_ARGS if getattr(args, name, None)]
    if identity is None and outside:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in outside)
        return unreadable_identity(flags, scope, f"{flags} take weights or config from outside --model-path")
    download_dir = getattr(args, "download_dir", None)
    try:
        if identity is None:
            identity = content_identity(str(args.model_path), getattr(args, "revision", None), download_dir)
            if not identity.num_weight_files:
                raise NoContentIdentity(f"{args.model_path} holds no weight file")
        # Also under HPKV_MODEL_ID: it names the weights, not the adapters.
        for name, path in lora_adapters(getattr(args, "lora_paths", None)):
            identity = identity.with_part(f"lora:{name}", content_identity(path, None, download_dir))
    except NoContentIdentity as exc:
        return unreadable_identity("weights not readable here", scope, str(exc))
    return identity


def lora_adapters(lora_paths) -> list[tuple[str, str]]:
    """(name, path) of every --lora-paths adapter, in any of the forms SGLang takes, by name."""
    if not lora_paths:
        return []
    items: list[tuple[str, str]] = []
    if isinstance(lora_paths, dict):
        items.extend(lora_paths.items())
    else:
        for entry in lora_paths:
            if isinstance(entry, str):
                name, _, path = entry.partition("=") if "=" in entry else (entry, "", entry)
            elif isinstance(entry, dict):
                name, path = entry["lora_name"], entry["lora_path"]
            else:  # a LoRARef
                name, path = entry.lora_name, entry.lora_path
            items.append((name, path))
    return sorted((str(name), str(path)) for name, path in items)


def model_text(args, identity: ModelIdentity) -> str:
    """The namespace's model field: the identity, plus online quantization, another compute
    dtype and config overrides (RoPE scaling, say), none of which the page hashes cover; each
    part escaped (`identity.model_text`)."""
    parts = []
    for name, default in NUMERICS_ARGS:
        value = getattr(args, name, default)
        if value != default and value is not None:
            parts.append((name, str(value)))
    overrides = getattr(args, "json_model_override_args", None) or "{}"
    try:
        overrides = json.dumps(json.loads(overrides), sort_keys=True)
    except (TypeError, ValueError):
        overrides = str(overrides)
    if overrides != "{}":
        parts.append(("json_model_override_args", overrides))
    return identity_text(identity.id, parts)
