"""Frame delimiting without decompression."""

import os

import pytest
import zstandard

from replay.capture.format.frames import (
    FrameError,
    find_next_frame,
    parse_frame,
    skippable_frame,
)


def test_data_and_skippable_frames_are_delimited():
    c = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True)
    a = c.compress(os.urandom(200_000) + b"x" * 300_000)  # several blocks, raw and RLE/compressed
    s = skippable_frame(0x184D2A5E, b"hello")
    b = c.compress(b"")
    buf = a + s + b
    f1 = parse_frame(buf, 0)
    assert (f1.end, f1.content_size, f1.skippable_magic) == (len(a), 500_000, None)
    f2 = parse_frame(buf, f1.end)
    assert f2.skippable_magic == 0x184D2A5E and buf[f2.payload_start:f2.end] == b"hello"
    f3 = parse_frame(buf, f2.end)
    assert f3.end == len(buf) and f3.content_size == 0
    assert find_next_frame(buf, 1) == f3.start  # skippable frames carry no zstd magic


@pytest.mark.parametrize("cut", [1, 3, 5, 9, 20])
def test_truncated_frames_say_so(cut):
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(os.urandom(1000))
    with pytest.raises(FrameError) as e:
        parse_frame(frame[: len(frame) - cut], 0)
    assert e.value.truncated


def test_garbage_is_not_a_frame():
    with pytest.raises(FrameError, match="no frame magic") as e:
        parse_frame(b"\x00" * 16, 0)
    assert not e.value.truncated
