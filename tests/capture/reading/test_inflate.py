"""`ChunkInflater` on a real mapped file: chunk frames with and without a declared size."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import zstandard

from replay.capture.reading.inflate import ChunkInflater, ChunkUnreadable


def _inflate_mapped(tmp_path: Path, frame: bytes) -> bytes:
    path = tmp_path / "frame.zst"
    path.write_bytes(b"pad" + frame)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        inflater = ChunkInflater(path, buf, zstandard.ZstdDecompressor(), 1 << 20)
        return inflater.inflate(3, 3 + len(frame), 0)


def test_a_frame_without_its_size_streams_from_the_mapping_and_lets_it_go(tmp_path):
    # (found by test_fuzz: the stream reader kept the mapping's view exported, and releasing it raised BufferError)
    data = bytes(range(256)) * 50
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    assert zstandard.get_frame_parameters(unsized).content_size == zstandard.CONTENTSIZE_UNKNOWN
    assert _inflate_mapped(tmp_path, unsized) == data


def test_a_frame_with_its_size_decompresses_whole(tmp_path):
    data = b"step" * 1000
    assert _inflate_mapped(tmp_path, zstandard.ZstdCompressor(write_content_size=True).compress(data)) == data


def test_a_corrupt_frame_without_its_size_is_unreadable_not_a_buffer_error(tmp_path):
    # (found by test_fuzz: the failing stream reader, alive in the traceback, kept the mapping's view exported, and
    # releasing the view raised BufferError instead of ChunkUnreadable)
    unsized = bytearray(zstandard.ZstdCompressor(write_content_size=False, write_checksum=True).compress(b"x" * 5000))
    unsized[-1] ^= 0xFF  # the checksum
    with pytest.raises(ChunkUnreadable):
        _inflate_mapped(tmp_path, bytes(unsized))
