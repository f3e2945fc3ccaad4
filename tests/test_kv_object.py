"""Pool objects verify every header field and the payload checksum: a mismatch is a miss, never data."""

from __future__ import annotations

import pytest
import torch

from shared.kv_object import HEADER_BYTES, ObjectSpec, checksum, object_key, verify, verify_header, write_header

SPEC = ObjectSpec("mrg1-abc", bytes(range(16)), 1, 2, 256, 4096)


def make(spec: ObjectSpec = SPEC) -> torch.Tensor:
    obj = torch.empty(HEADER_BYTES + spec.payload_bytes, dtype=torch.uint8)
    obj[HEADER_BYTES:] = torch.randint(0, 256, (spec.payload_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    write_header(obj, spec, checksum(obj[HEADER_BYTES:]))
    return obj


def test_valid_object_verifies():
    assert verify(make(), SPEC) is None


@pytest.mark.parametrize("field,value", [("namespace", "mrg1-other"), ("digest", bytes(16)), ("stage", 0),
                                         ("stages", 3), ("tokens", 128)])
def test_header_naming_another_object_is_rejected(field, value):
    other = ObjectSpec(**{**SPEC.__dict__, field: value})
    assert "another object" in verify(make(), other)


def test_flipped_payload_bit_is_rejected():
    obj = make()
    obj[HEADER_BYTES + 1000] ^= 4
    assert verify(obj, SPEC) == "payload checksum mismatch"


def test_a_crc_computed_by_the_caller_is_the_one_compared():
    """A restore checksums the payload while unpacking it and hands verify that CRC: verify then trusts
    it (and does not read the payload again), and still checks every header field."""
    obj = make()
    good = checksum(obj[HEADER_BYTES:])
    assert verify(obj, SPEC, payload_crc=good) is None
    assert verify(obj, SPEC, payload_crc=good ^ 1) == "payload checksum mismatch"
    obj[HEADER_BYTES + 1000] ^= 4  # the bytes changed after the caller's CRC: not verify's to see
    assert verify(obj, SPEC, payload_crc=good) is None
    assert "another object" in verify(make(), ObjectSpec(**{**SPEC.__dict__, "stage": 0}), payload_crc=good)


def test_wrong_size_and_garbage_are_rejected():
    assert "size" in verify(make()[:-1], SPEC)
    assert verify(torch.zeros(HEADER_BYTES + 4096, dtype=torch.uint8), SPEC) == "not a moorage KV object"


def test_key_names_namespace_stage_and_digest():
    assert object_key("mrg1-abc", 1, 2, bytes(range(16))) == "mrg1-abc/s1of2/" + bytes(range(16)).hex()


def test_oversized_namespace_is_refused():
    with pytest.raises(ValueError):
        write_header(torch.zeros(HEADER_BYTES, dtype=torch.uint8), ObjectSpec("x" * 65, bytes(16), 0, 1, 256, 0), 0)


def test_checksum_is_crc32c():
    """Format 2 checksums with CRC-32C (check value of "123456789": 0xE3069283)."""
    assert checksum(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)) == 0xE3069283


def test_older_format_version_is_refused():
    """A format-1 object (zlib CRC-32) is refused by its version, never checked with the wrong CRC."""
    import struct
    import zlib

    from shared.kv_object import FORMAT_VERSION, MAGIC, _HEADER

    assert FORMAT_VERSION == 2
    obj = make()
    raw = _HEADER.pack(MAGIC, 1, SPEC.stage, SPEC.stages, SPEC.tokens, SPEC.payload_bytes,
                       zlib.crc32(obj[HEADER_BYTES:].numpy()), SPEC.digest, SPEC.namespace.encode())
    obj[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    assert verify(obj, SPEC) == "format version 1, not 2"
    assert struct.unpack_from("<H", obj[:8].numpy().tobytes(), 6) == (1,)


def test_header_verified_apart_from_its_payload():
    """A restore in place reads the header into its own buffer and the payload into the blocks: the header
    alone is checked against the CRC of the payload read in pieces (chained), like a whole object."""
    obj = make()
    header, payload = obj[:HEADER_BYTES].clone(), obj[HEADER_BYTES:]
    pieces = checksum(payload[2000:], checksum(payload[:2000]))
    assert pieces == checksum(payload)
    assert verify_header(header, SPEC, pieces) is None
    assert verify_header(header, SPEC, pieces ^ 1) == "payload checksum mismatch"
    assert "another object" in verify_header(header, ObjectSpec(**{**SPEC.__dict__, "stage": 0}), pieces)
    assert "header size" in verify_header(obj[:HEADER_BYTES - 1], SPEC, pieces)
    header[0] ^= 1
    assert verify_header(header, SPEC, pieces) == "not a moorage KV object"
