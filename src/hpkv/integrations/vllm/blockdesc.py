"""One block as vLLM's own `BlockStored` describes it, and its bytes as the HPKV server keeps them
for the engines that start later (`protocol.Journal.describe`; the server never reads them).

The hashes are kept raw (vLLM's `BlockHash` bytes) and converted when an event is made
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` is the publishing engine's, not the describing one's).
The bytes come back from a server other clients write to: `decode` checks every field's type and
the token count against the block size, and answers None for anything else (the block is then
announced once a request touches it, as without a description).
Primitives: `BlockMeta`, `encode`, `decode`. Must not know: the tiers, the server.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import msgspec

MAX_EXTRA_KEYS = 256  # per block, as decoded


@dataclass(slots=True)
class BlockMeta:
    """One block as vLLM's own `BlockStored` describes it (hashes raw)."""

    block_hash: bytes
    parent: bytes | None
    token_ids: array  # 4 bytes a token, not a list of int objects
    block_size: int
    extra_keys: tuple | None
    lora_name: str | None
    lora_id: int | None
    session_id: str | None


class _Wire(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    block_hash: bytes
    parent: bytes | None
    token_ids: bytes  # array("i") of block_size tokens
    block_size: int
    extra_keys: list[tuple[Any, ...]] | None  # vLLM's keys: a tag, then scalars
    lora_name: str | None
    lora_id: int | None
    session_id: str | None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Wire)


def encode(meta: BlockMeta) -> bytes:
    extra = list(meta.extra_keys) if meta.extra_keys is not None else None
    return _encoder.encode(
        _Wire(
            bytes(meta.block_hash),
            bytes(meta.parent) if meta.parent is not None else None,
            meta.token_ids.tobytes(),
            meta.block_size,
            extra,
            meta.lora_name,
            meta.lora_id,
            meta.session_id,
        )
    )


def decode(blob: bytes, block_size: int) -> BlockMeta | None:
    """The block `blob` describes, if it is a description of a block of `block_size` tokens."""
    try:
        wire = _decoder.decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    tokens = array("i")
    if wire.block_size != block_size or len(wire.token_ids) != block_size * tokens.itemsize:
        return None
    extra = tuple(wire.extra_keys) if wire.extra_keys is not None else None
    if extra is not None and (len(extra) > MAX_EXTRA_KEYS or any(isinstance(v, list | dict) for k in extra for v in k)):
        return None
    tokens.frombytes(wire.token_ids)
    return BlockMeta(
        wire.block_hash, wire.parent, tokens, block_size, extra, wire.lora_name, wire.lora_id, wire.session_id
    )
