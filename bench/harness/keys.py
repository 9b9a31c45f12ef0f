"""Keys and namespace descriptions for benchmarks: deterministic, so two runs (and two stores in
one run) see the same keys. Primitives: `keys(n, tag)`, `key(text)`, `namespace(model, entry_bytes)`."""

from __future__ import annotations

import hashlib

from hpkv.keys import NamespaceDesc, make_key


def key(text: str) -> bytes:
    """The entry key named by `text` (its SHA-256, as an engine's block hash would be)."""
    return make_key(hashlib.sha256(text.encode()).digest())


def keys(n: int, tag: str) -> list[bytes]:
    """`n` keys named `f"{tag}{i}"`: the same tag gives the same keys, another tag other keys."""
    return [key(f"{tag}{i}") for i in range(n)]


def namespace(
    model: str, entry_bytes: int, *, dtype: str = "float16", block_size: int = 32, num_layers: int = 2
) -> NamespaceDesc:
    """A benchmark's namespace (engine "bench"): one entry of `entry_bytes` per block."""
    return NamespaceDesc(
        engine="bench",
        model=model,
        dtype=dtype,
        layout="blocks",
        block_size=block_size,
        num_layers=num_layers,
        entry_bytes=entry_bytes,
    )
