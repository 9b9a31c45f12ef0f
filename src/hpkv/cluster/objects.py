"""The cluster tier's objects: their names in Mooncake and their format.

An object is HPKV's own entry header (`storage.format`, version 1: namespace digest, key,
payload length, xxh3 of the payload, a checksum of the header) followed by the payload, and is
checked field by field on every read: an object from the cluster is as untrusted as a file.
Its name in Mooncake is derived from the namespace id and the key (`object_name`), so two models
(two namespaces) never share one, and one namespace's objects can be removed by a pattern.
Owns: `object_name`, `namespace_pattern`, `header_len`, `make_header`, `verify`.
Must not know: Mooncake's client, the pool, the store.
"""

from __future__ import annotations

import re

from ..storage import format as entry_format

PREFIX = "hpkv/"  # every HPKV object's name starts so: other users of the cluster are left alone


def object_name(ns: str, key: bytes) -> str:
    """`hpkv/<namespace id>/<key in hex>`: a namespace id is the hex of its digest."""
    return f"{PREFIX}{ns}/{key.hex()}"


def namespace_pattern(ns: str | None) -> str:
    """The regular expression of the names of `ns`'s objects (every HPKV object's for None)."""
    return "^" + re.escape(PREFIX + (f"{ns}/" if ns is not None else ""))


def header_len(key: bytes) -> int:
    return entry_format.header_bytes(len(key))


def make_header(ns: str, key: bytes, payload: memoryview | bytes) -> bytes:
    return entry_format.encode_header(bytes.fromhex(ns), key, payload)


def verify(ns: str, key: bytes, header: memoryview | bytes, payload: memoryview) -> str | None:
    """None when `header` is exactly what `make_header(ns, key, payload)` made; else why not."""
    return entry_format.check(header, bytes.fromhex(ns), key, payload)
