"""What `hpkv clear` removes: namespace ids from what people type, and storage cleared without
a server.

A namespace id is opaque; people know the model they served. `model_namespaces(name, ...)`
finds every namespace whose model identity is that model's: the content identity of the path
or hub id (read as the engines read it, `hpkv.identity`), or the `HPKV_MODEL_ID` value it was
served under. Namespaces are found in the server's stats and in `<storage>/<ns>/namespace.json`.

Primitives: `storage_namespaces`, `resolve_ns`, `model_identities`, `model_namespaces`,
`clear_storage_directly`. Must not know: the protocol, the pool.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import click

from .config import Settings
from .identity import NoContentIdentity, content_identity, override_identity
from .keys import NS_DIGEST_BYTES

_DESC_MAX_BYTES = 1 << 20  # a namespace.json is a few hundred bytes; anything larger is not one


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
    and the HPKV_MODEL_ID value."""
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
        descs.setdefault(ns, _read_desc(storage_path / ns / "namespace.json"))
    return sorted(ns for ns, desc in descs.items() if _model_of(desc) in ids or _based_on(_model_of(desc), ids))


def clear_storage_directly(settings: Settings, ns: str | None) -> int | None:
    """Remove the entry files (of `ns`) with no server; None when the directory does not exist."""
    from .storage.tier import StorageTier

    if not Path(settings.storage.path).is_dir():
        return None
    tier = StorageTier(settings.storage)
    tier.start()
    try:
        return tier.remove(ns)
    finally:
        tier.close()


def _model_of(desc: str) -> str:
    try:
        model = json.loads(desc).get("model", "")
    except (ValueError, AttributeError):
        return ""
    return model if isinstance(model, str) else ""


def _based_on(model: str, ids: list[str]) -> bool:
    """The engines append what changes the numerics on load (`+quantization=...`) to the id."""
    return any(model.startswith(i + "+") for i in ids)


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
