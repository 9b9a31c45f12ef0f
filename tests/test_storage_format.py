"""Stories about the on-disk entry format: what was written reads back, and any field that changes
makes the file bad, with a reason that says which."""

from __future__ import annotations

import struct

import pytest
import xxhash

from hpkv.storage import format as fmt

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
KEY = b"block-hash-0001"
PAYLOAD = bytes(range(256)) * 64


def reseal(header: bytearray, key_len: int) -> bytearray:
    """Recompute the header checksum after a deliberate edit, so that only the edited field differs."""
    fixed = bytes(header[:48])
    key = bytes(header[52 : 52 + key_len])
    header[48:52] = struct.pack("<I", xxhash.xxh32_intdigest(fixed + key))
    return header


def test_a_header_and_payload_written_together_check_clean():
    header = fmt.encode_header(NS, KEY, PAYLOAD)

    assert fmt.check(header, NS, KEY, memoryview(PAYLOAD)) is None


def test_the_header_is_padded_to_a_multiple_of_eight_bytes():
    for key_len in range(0, 70):
        header = fmt.encode_header(NS, b"k" * key_len, PAYLOAD)
        assert len(header) == fmt.header_bytes(key_len)
        assert len(header) % 8 == 0
        assert len(header) >= 52 + key_len


def test_an_empty_payload_round_trips():
    header = fmt.encode_header(NS, KEY, b"")

    assert fmt.check(header, NS, KEY, memoryview(b"")) is None


def test_a_changed_magic_is_not_an_hpkv_file():
    header = bytearray(fmt.encode_header(NS, KEY, PAYLOAD))
    header[0:8] = b"HPKVKV\n\n"  # what a text-mode CR LF -> LF translation would leave

    assert fmt.check(reseal(header, len(KEY)), NS, KEY, memoryview(PAYLOAD)) == "not an HPKV file"


def test_a_changed_version_is_reported_with_both_numbers():
    header = bytearray(fmt.encode_header(NS, KEY, PAYLOAD))
    header[8:10] = struct.pack("<H", 3)

    reason = fmt.check(reseal(header, len(KEY)), NS, KEY, memoryview(PAYLOAD))

    assert reason == "format version 3, expected one of (1, 2)"


def test_a_version_that_does_not_match_the_files_layout_is_rejected():
    header = bytearray(fmt.encode_header(NS, KEY, PAYLOAD))
    header[8:10] = struct.pack("<H", fmt.VERSION_ALIGNED)

    reason = fmt.check(reseal(header, len(KEY)), NS, KEY, memoryview(PAYLOAD))

    assert reason == "format version 2 in a file of version 1's size"


def test_the_aligned_version_puts_the_payload_at_4_kib_and_checks_like_the_first():
    header = fmt.encode_header(NS, KEY, PAYLOAD, fmt.VERSION_ALIGNED)

    assert len(header) == fmt.ALIGN == fmt.header_bytes(len(KEY), fmt.VERSION_ALIGNED)
    assert fmt.check(header, NS, KEY, memoryview(PAYLOAD), fmt.VERSION_ALIGNED) is None
    assert fmt.version_of_size(fmt.ALIGN + len(PAYLOAD), len(KEY), len(PAYLOAD)) == fmt.VERSION_ALIGNED
    assert fmt.version_of_size(fmt.header_bytes(len(KEY)) + len(PAYLOAD), len(KEY), len(PAYLOAD)) == fmt.VERSION
    assert fmt.version_of_size(fmt.ALIGN + len(PAYLOAD) + 1, len(KEY), len(PAYLOAD)) is None


def test_a_file_of_another_namespace_is_rejected():
    header = fmt.encode_header(OTHER_NS, KEY, PAYLOAD)

    assert fmt.check(header, NS, KEY, memoryview(PAYLOAD)) == "belongs to another namespace"


def test_a_file_of_another_key_is_rejected():
    header = fmt.encode_header(NS, b"block-hash-0002", PAYLOAD)

    assert fmt.check(header, NS, KEY, memoryview(PAYLOAD)) == "holds another key"


def test_a_key_of_another_length_is_rejected():
    header = fmt.encode_header(NS, KEY + b"x", PAYLOAD)

    assert fmt.check(header, NS, KEY, memoryview(PAYLOAD)) == "holds another key"


def test_a_changed_payload_length_is_rejected():
    header = bytearray(fmt.encode_header(NS, KEY, PAYLOAD))
    header[32:40] = struct.pack("<Q", len(PAYLOAD) + 8)

    reason = fmt.check(reseal(header, len(KEY)), NS, KEY, memoryview(PAYLOAD))

    assert reason == f"payload of {len(PAYLOAD) + 8} bytes, expected {len(PAYLOAD)}"


def test_one_flipped_payload_bit_fails_the_payload_checksum():
    header = fmt.encode_header(NS, KEY, PAYLOAD)
    payload = bytearray(PAYLOAD)
    payload[1000] ^= 0x10

    assert fmt.check(header, NS, KEY, memoryview(payload)) == "payload checksum mismatch"


def test_a_changed_payload_checksum_field_fails_the_payload_checksum():
    header = bytearray(fmt.encode_header(NS, KEY, PAYLOAD))
    header[40] ^= 0x01

    assert fmt.check(reseal(header, len(KEY)), NS, KEY, memoryview(PAYLOAD)) == "payload checksum mismatch"


@pytest.mark.parametrize("offset", [0, 8, 10, 12, 16, 31, 32, 40, 47, 52, 52 + len(KEY) - 1])
def test_one_flipped_header_bit_without_resealing_is_caught(offset):
    header = bytearray(fmt.encode_header(NS, KEY, PAYLOAD))
    header[offset] ^= 0x04

    assert fmt.check(header, NS, KEY, memoryview(PAYLOAD)) is not None


def test_a_changed_header_checksum_is_reported_as_such():
    header = bytearray(fmt.encode_header(NS, KEY, PAYLOAD))
    header[48] ^= 0x80

    assert fmt.check(header, NS, KEY, memoryview(PAYLOAD)) == "header checksum mismatch"


def test_a_changed_reserved_field_fails_the_header_checksum():
    header = bytearray(fmt.encode_header(NS, KEY, PAYLOAD))
    header[12] = 1

    assert fmt.check(header, NS, KEY, memoryview(PAYLOAD)) == "header checksum mismatch"


def test_a_header_cut_short_is_rejected():
    header = fmt.encode_header(NS, KEY, PAYLOAD)

    assert fmt.check(header[:40], NS, KEY, memoryview(PAYLOAD)) == "short header"


def test_zeros_are_not_an_hpkv_file():
    header = bytes(fmt.header_bytes(len(KEY)))

    assert fmt.check(header, NS, KEY, memoryview(PAYLOAD)) == "not an HPKV file"


def test_a_flipped_bit_in_the_padding_is_caught():
    header = bytearray(fmt.encode_header(NS, KEY, PAYLOAD))
    assert len(header) > 52 + len(KEY), "this key must leave padding"
    header[-1] ^= 0x01

    assert fmt.check(header, NS, KEY, memoryview(PAYLOAD)) == "padding is not zero"
