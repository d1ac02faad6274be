"""`bounds`: a capture's prologue and seek index, each checked before it is trusted; an index that fails a check is
one damage line, and the reader then scans the frames (tests/capture/reading/test_reader.py)."""

from __future__ import annotations

import struct

import pytest
import zstandard

from replay.capture.format import records as fmt
from replay.capture.reading.bounds import load_index, read_prologue
from replay.errors import UnsupportedVersionError

TRAILER = 4 + 8 + len(fmt.INDEX_TRAILER_ID)  # crc, index offset, trailer id


def _index(data: bytes):
    _, end = read_prologue(None, data)
    return load_index(data, len(data), end, zstandard.ZstdDecompressor())


def test_a_sealed_capture_has_an_index_that_tiles_its_chunks(small_capture_bytes):
    (major, _), end = read_prologue(None, small_capture_bytes)
    index, damage = _index(small_capture_bytes)
    assert major == fmt.FORMAT_MAJOR and not damage
    assert index.chunks[0].offset == end and len(index.chunks) > 1


def test_an_unsealed_capture_has_no_index_and_no_damage(small_capture_bytes):
    index_at = struct.unpack_from("<Q", small_capture_bytes, len(small_capture_bytes) - 16)[0]
    assert _index(small_capture_bytes[:index_at]) == (None, [])


@pytest.mark.parametrize(("where", "why"), [(-TRAILER + 4, "index offset past the end of the file"),
                                            (-TRAILER, "index checksum mismatch"),
                                            (-TRAILER + 4, "index frame not where the trailer says")])
def test_an_index_that_fails_a_check_is_one_damage_line(small_capture_bytes, where, why):
    data = bytearray(small_capture_bytes)
    n = len(data) + where
    if why.startswith("index offset"):
        struct.pack_into("<Q", data, n, len(data) + 5)
    elif why.startswith("index frame"):  # a real frame, but the first chunk's
        struct.pack_into("<Q", data, n, read_prologue(None, small_capture_bytes)[1])
    else:
        data[n] ^= 0xFF
    index, [damage] = _index(bytes(data))
    assert index is None and damage.kind == "index" and why in damage.reason, damage


def test_a_newer_major_format_is_refused_with_what_to_do(small_capture_bytes):
    data = bytearray(small_capture_bytes)
    struct.pack_into("<H", data, 16, fmt.FORMAT_MAJOR + 1)  # the prologue's payload: id (8 bytes), major, minor
    with pytest.raises(UnsupportedVersionError, match="upgrade replay to read it"):
        read_prologue(None, bytes(data))
