"""Entry keys and namespaces.

An entry key is the engine's own block hash at a block boundary (vLLM `Request.block_hashes`,
SGLang page hash strings), taken as the engine gives it. These hashes already chain over the
whole prefix and cover LoRA, multimodal inputs and cache salts, so HPKV never derives keys from
token ids itself.

A namespace separates entries whose bytes are incompatible: engine, model, dtype, layout, block
size, layers, parallel sizes, rank and entry size. Its id is a digest of a canonical description;
the description is kept in readable form beside the data (`<ns>/namespace.json`).

Primitives: `make_key`, `NamespaceDesc`, `NamespaceDesc.ns`.
Must not know: pools, files, engines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import NewType

Key = NewType("Key", bytes)

MAX_KEY_BYTES = 64
# Longer keys are replaced by a digest so that every key fits a file name. The tag byte keeps the
# digest of a long key from ever equalling a short key given verbatim.
_LONG_KEY_TAG = b"\xffH"
NS_DIGEST_BYTES = 16


def make_key(raw: bytes | str) -> Key:
    """The one constructor of keys: bytes as given, str as UTF-8, long keys by digest."""
    if isinstance(raw, str):
        raw = raw.encode()
    elif not isinstance(raw, bytes):
        raw = bytes(raw)
    if len(raw) <= MAX_KEY_BYTES and not raw.startswith(_LONG_KEY_TAG):
        return Key(raw)
    return Key(_LONG_KEY_TAG + hashlib.blake2b(raw, digest_size=32).digest())


@dataclasses.dataclass(frozen=True)
class NamespaceDesc:
    """Everything that makes one engine's KV bytes incompatible with another's."""

    engine: str
    model: str
    dtype: str
    layout: str
    block_size: int
    num_layers: int
    entry_bytes: int
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    rank: int = 0
    extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "entry_bytes", "tp_size", "pp_size", "cp_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"NamespaceDesc.{name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"NamespaceDesc.rank must be an int >= 0, got {self.rank!r}")

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["extra"] = dict(self.extra)
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> NamespaceDesc:
        fields = json.loads(text)
        fields["extra"] = tuple(sorted(fields.get("extra", {}).items()))
        return cls(**fields)

    @property
    def digest(self) -> bytes:
        return hashlib.blake2b(self.to_json().encode(), digest_size=NS_DIGEST_BYTES).digest()

    @property
    def ns(self) -> str:
        """The namespace id: hex of the digest, used in paths and in the protocol."""
        return self.digest.hex()
