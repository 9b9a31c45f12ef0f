"""What `hpkv clear` removes: namespace ids from what people type, and storage cleared without
a server.

A namespace id is opaque; people know the model they served. `model_namespaces(name, ...)`
finds every namespace whose model identity is exactly that model's: the content identity of the
path or hub id (read as the engines read it, `hpkv.identity`: `model_identities` is the one place
that asks it), or the `HPKV_MODEL_ID` value it was served under, or an identity as `hpkv status`
shows it. A namespace's model field is that identity alone or followed by the parts the engines
add on load (`LOAD_PARTS`: `+quantization=fp8`, `+draft=<identity>`...); any other text after it
(`llama+v2-finetune` is not `llama`) is another model. Namespaces are found in the server's stats
and in `<storage>/<ns>/namespace.json`, which counts only where it hashes to its directory's name
(`NamespaceDesc.ns`): the tree may be writable by others, and a relabelled file names nothing.

Primitives: `storage_namespaces`, `resolve_ns`, `model_identities`, `is_model`, `model_namespaces`,
`clear_storage_directly`. Must not know: the protocol, the pool.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import click

from .config import Settings
from .identity import NoContentIdentity, content_identity, override_identity
from .keys import NS_DIGEST_BYTES, NamespaceDesc

_DESC_MAX_BYTES = 1 << 20  # a namespace.json is a few hundred bytes; anything larger is not one
# What the engines append to an identity on load (`vllm/modelid.model_text`, `ModelIdentity.with_part`,
# `sglang/modelid.model_text`, `sglang/layout`): each `+<name>=<value>`, or `+<name>` alone.
LOAD_PARTS = (
    "quantization",
    "quantization_config",
    "hf_overrides",
    "model_class_overrides",
    "disable_sliding_window",
    "kv_cache_dtype_skip_layers",
    "hf_config",
    "draft",
    "lora:",
    "modelopt_quant",
    "dtype",
    "qsa_indexer_dtype",
    "json_model_override_args",
    "kv_scales",
)
_RAW_ID_PREFIXES = ("content:", "HPKV_MODEL_ID:", "private:")  # an identity as `hpkv status` shows it


def storage_namespaces(storage_path: Path) -> list[str]:
    try:
        names = [entry.name for entry in storage_path.iterdir() if entry.is_dir()]
    except OSError:
        return []
    return [n for n in names if len(n) == 2 * NS_DIGEST_BYTES and all(c in "0123456789abcdef" for c in n)]


def resolve_ns(prefix: str | None, known: list[str]) -> str | None:
    """A namespace id from an id or a unique prefix of one (as `hpkv status` shows them)."""
    if prefix is None:
        return None
    prefix = prefix.lower()
    if not prefix or len(prefix) > 32 or any(c not in "0123456789abcdef" for c in prefix):
        raise click.BadParameter(
            f"{prefix!r} is not a namespace id (hex, as `hpkv status` shows)", param_hint="--namespace"
        )
    matches = sorted({ns for ns in known if ns.startswith(prefix)})
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise click.BadParameter(
            f"{prefix!r} matches several namespaces: {', '.join(matches)}; give more of it", param_hint="--namespace"
        )
    if len(prefix) == 32:
        return prefix
    raise click.BadParameter(f"no namespace id starts with {prefix!r}", param_hint="--namespace")


def model_identities(name: str) -> list[str]:
    """The identities `name` may have been served under: its content (where it can be read here)
    and the HPKV_MODEL_ID value; an identity given as such, itself."""
    if name.startswith(_RAW_ID_PREFIXES):
        return [name]
    ids = [override_identity(name).id]
    try:
        ids.insert(0, content_identity(name).id)
    except NoContentIdentity:
        pass  # served under HPKV_MODEL_ID, or not on this node: the override id still matches
    return ids


def model_namespaces(name: str, server_descs: Mapping[str, str], storage_path: Path) -> list[str]:
    """Every namespace (in the server's stats or in storage) whose model is `name`, sorted."""
    ids = model_identities(name)
    descs = dict(server_descs)
    for ns in storage_namespaces(storage_path):
        if ns not in descs:
            descs[ns] = _read_desc(storage_path / ns / "namespace.json")
    return sorted(ns for ns, desc in descs.items() if any(is_model(_model_of(ns, desc), i) for i in ids))


def clear_storage_directly(settings: Settings, ns: str | None) -> int | None:
    """Remove the entry files (of `ns`) with no server (`storage_tier.remove_without_tier`: no
    tier started, no lease in a cluster); None when the directory does not exist."""
    from .storage.storage_tier import remove_without_tier

    if not Path(settings.storage.path).is_dir():
        return None
    return remove_without_tier(settings.storage, ns)


def _model_of(ns: str, desc: str) -> str | None:
    """The model field of a namespace's description; None unless the description is one and
    hashes to `ns`."""
    try:
        parsed = NamespaceDesc.from_json(desc)
    except (ValueError, TypeError, AttributeError):
        return None
    return parsed.model if parsed.ns == ns else None


def is_model(model: str | None, identity: str) -> bool:
    """Whether a namespace's model field is `identity`, alone or with the parts engines add on load."""
    if model is None or not model.startswith(identity):
        return False
    rest = model[len(identity) :]
    if not rest:
        return True
    if not rest.startswith("+"):
        return False
    part = rest[1:]
    return any(
        part.startswith(name) if name.endswith(":") else part == name or part.startswith((name + "=", name + "+"))
        for name in LOAD_PARTS
    )


def _read_desc(path: Path) -> str:
    """The file's text, or "" where it is missing, not a regular file or too large (not followed
    if it is a link: the tree may be writable by others)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return os.read(fd, _DESC_MAX_BYTES).decode(errors="replace")
    except OSError:  # a directory, a FIFO that never answers: not a description
        return ""
    finally:
        os.close(fd)
