"""The on-disk format of one entry: a small header, then the payload.

    offset  size  field
    0       8     magic  b"HPKVKV\\r\\n" (the CR LF catches text-mode mangling)
    8       2     format version (1 or 2)
    10      2     key length
    12      4     reserved, 0
    16      16    namespace digest
    32      8     payload length
    40      8     xxh3-64 of the payload
    48      4     xxh32 of bytes 0..48 and the key
    52      n     key
    52+n    pad   zeros up to a multiple of 8 (version 1) or of 4096 (version 2)

All little-endian. Version 2 puts the payload at 4096, so it can be written and read with
`O_DIRECT` straight from and into pool slots; it is written with direct I/O for a payload that is
a multiple of 4096 bytes, version 1 otherwise. Readers take both, telling them apart by the file's
size. A reader knows the namespace, key and payload length it expects, so it reads header and
payload with one `preadv` and checks every field: any difference makes the file bad, except an
HPKV file of a newer version (`newer_version`), which is left for the nodes that can read it.
Must not know: paths, the index, the pool.
"""

from __future__ import annotations

import mmap
import struct

import xxhash

MAGIC = b"HPKVKV\r\n"
VERSION = 1
VERSION_ALIGNED = 2
ALIGN = 4096  # version 2's header length: O_DIRECT wants file offsets and buffers aligned
VERSIONS = (VERSION, VERSION_ALIGNED)
_FIXED = struct.Struct("<8sHHI16sQQ")
_HEADER_SUM = struct.Struct("<I")


def header_bytes(key_len: int, version: int = VERSION) -> int:
    step = ALIGN if version == VERSION_ALIGNED else 8
    return -(-(_FIXED.size + _HEADER_SUM.size + key_len) // step) * step


def encode_header(ns_digest: bytes, key: bytes, payload: memoryview | bytes, version: int = VERSION) -> bytes:
    fixed = _FIXED.pack(MAGIC, version, len(key), 0, ns_digest, len(payload), xxhash.xxh3_64_intdigest(payload))
    summed = fixed + key
    out = bytearray(header_bytes(len(key), version))
    out[: len(fixed)] = fixed
    out[len(fixed) : len(fixed) + 4] = _HEADER_SUM.pack(xxhash.xxh32_intdigest(summed))
    out[len(fixed) + 4 : len(fixed) + 4 + len(key)] = key
    return bytes(out)


def newer_version(head: bytes | bytearray | memoryview | mmap.mmap) -> int | None:
    """The version of an HPKV file written by a newer HPKV (one this reader does not know), from
    its first 10 bytes; None for every other file."""
    if len(head) < 10 or bytes(head[:8]) != MAGIC:
        return None
    version = int.from_bytes(bytes(head[8:10]), "little")
    return version if version > max(VERSIONS) else None


def declared_bytes(head: bytes | bytearray | memoryview) -> int | None:
    """The size of the whole file an HPKV header of a version this reader knows declares (header
    and payload), from the file's first bytes (the header with its key: ALIGN of them holds any);
    None where they are no such header, its checksum included."""
    if len(head) < _FIXED.size + _HEADER_SUM.size:
        return None
    magic, version, key_len, _, _, length, _ = _FIXED.unpack_from(head)
    end = _FIXED.size + _HEADER_SUM.size + key_len
    if magic != MAGIC or version not in VERSIONS or len(head) < end:
        return None
    (header_sum,) = _HEADER_SUM.unpack_from(head, _FIXED.size)
    if xxhash.xxh32_intdigest(bytes(head[: _FIXED.size]) + bytes(head[_FIXED.size + 4 : end])) != header_sum:
        return None
    return header_bytes(key_len, version) + length


def version_of_size(file_size: int, key_len: int, payload_len: int) -> int | None:
    """The version whose layout gives a file of `file_size` bytes for this key and payload, or
    None: the file is bad."""
    for version in VERSIONS:
        if file_size == header_bytes(key_len, version) + payload_len:
            return version
    return None


def check(
    header: bytes | bytearray | memoryview | mmap.mmap,
    ns_digest: bytes,
    key: bytes,
    payload: memoryview,
    expected_version: int = VERSION,
) -> str | None:
    """None when header and payload are exactly what was written for (ns, key) in the layout of
    `expected_version` (from the file's size); else the reason."""
    if len(header) < _FIXED.size + 4:
        return "short header"
    magic, version, key_len, _, digest, length, payload_sum = _FIXED.unpack_from(header)
    if magic != MAGIC:
        return "not an HPKV file"
    if version != expected_version:
        if version not in VERSIONS:
            return f"format version {version}, expected one of {VERSIONS}"
        return f"format version {version} in a file of version {expected_version}'s size"
    stored_key = bytes(header[_FIXED.size + 4 : _FIXED.size + 4 + key_len])
    (header_sum,) = _HEADER_SUM.unpack_from(header, _FIXED.size)
    if xxhash.xxh32_intdigest(bytes(header[: _FIXED.size]) + stored_key) != header_sum:
        return "header checksum mismatch"
    if digest != ns_digest:
        return "belongs to another namespace"
    if stored_key != key:
        return "holds another key"
    if any(header[_FIXED.size + 4 + key_len :]):
        return "padding is not zero"  # outside both checksums, so checked on its own
    if length != len(payload):
        return f"payload of {length} bytes, expected {len(payload)}"
    if xxhash.xxh3_64_intdigest(payload) != payload_sum:
        return "payload checksum mismatch"
    return None
