"""Deterministic test data: keys named by a prefix and an index, payloads any process can check
again from the key alone, and the namespace description of the server tests."""

from __future__ import annotations

import hashlib

from hpkv.keys import NamespaceDesc, make_key

ENTRY_BYTES = 256 << 10


def entry_key(prefix: str, i: int | str) -> bytes:
    return make_key(hashlib.sha256(f"{prefix}-{i}".encode()).digest())


def entry_keys(n: int, prefix: str) -> list[bytes]:
    return [entry_key(prefix, i) for i in range(n)]


def fill(seed: bytes, size: int) -> bytes:
    """`size` bytes only `seed` gives: its BLAKE2b digest, repeated."""
    block = hashlib.blake2b(seed).digest()
    return (block * (size // len(block) + 1))[:size]


def payload(key: bytes, rank: int = 0, size: int = ENTRY_BYTES) -> bytes:
    """What rank `rank` saves under `key`."""
    return fill(key + bytes([rank]), size)


def desc(rank: int = 0, entry_bytes: int = ENTRY_BYTES, model: str = "tiny-llm") -> NamespaceDesc:
    return NamespaceDesc(
        engine="test",
        model=model,
        dtype="bfloat16",
        layout="blocks",
        block_size=16,
        num_layers=4,
        entry_bytes=entry_bytes,
        tp_size=2,
        rank=rank,
    )
