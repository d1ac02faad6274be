"""The engine thread's frames, packed partly by hand, decode as the msgpack the writer process expects."""

from __future__ import annotations

import msgspec
import pytest

from replay.capture.codec.step_image import OutputParts
from replay.capture.writing.wire import output_frame, scheduled_frame


@pytest.mark.parametrize("ints", [(0, 0, 0), (7, 1_700_000_000_123_456_789, 12), (2**63 - 1, -1, -(2**63))])
def test_hand_packed_frames_decode_as_msgpack(ints):
    image = msgspec.msgpack.encode({"total_num_scheduled_tokens": 3, "req_ids": ["a"]})
    first, a, b = ints
    kind, *parts = scheduled_frame(first, image, a, b)
    assert kind == b"P"
    assert msgspec.msgpack.decode(b"".join(parts)) == [first, msgspec.msgpack.decode(image), a, b]
    kind, *parts = output_frame(first, image, a, b)
    assert kind == b"O" and msgspec.msgpack.decode(b"".join(parts), type=tuple[int, msgspec.Raw, int, int])[1] == \
        msgspec.Raw(image)


def test_an_output_in_parts_travels_as_its_own_kind():
    parts = OutputParts(b"\x80", b"\x91\x91\x07", ("int32", "float32", "int64"), (1, 1), None,
                        (b"\x07\0\0\0", b"\0\0\x80\xbf", b"\x01" + b"\0" * 7))
    kind, payload = output_frame(3, parts, 10, 20)
    assert kind == b"L"
    assert msgspec.msgpack.decode(payload, type=tuple[int, OutputParts, int, int]) == (3, parts, 10, 20)
