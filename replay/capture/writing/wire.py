"""The engine thread's frames for the writer process (`writer_process`), built without re-encoding the images they
carry: a step's images are written into the pipe as they are, between a few bytes packed by hand."""

from __future__ import annotations

import struct

import msgspec

from replay.capture.codec.step_image import OutputParts
from replay.capture.writing import frame_protocol as fp

_ENCODER = msgspec.msgpack.Encoder()
# msgpack by hand: an array's fixarray byte and its first int; then n more ints (uint64 0xcf / int64 0xd3, big-endian)
_HEAD = struct.Struct(">BBQ")
_TAIL = {n: struct.Struct(">" + "BQ" * n) for n in range(4)}


def _int_head(v: int) -> tuple[int, int]:
    return (0xCF, v) if v >= 0 else (0xD3, v & 0xFFFFFFFFFFFFFFFF)


def _array_frame(kind: bytes, first: int, image: bytes, *rest: int) -> tuple[bytes, bytes, bytes, bytes]:
    """A frame whose payload is the msgpack array [first, image, *rest], the image written as it is (no copy):
    the engine thread's share of a step is two of these (vllm_bench). The ints go as uint64/int64 (msgpack
    allows any width), packed by one struct call each side of the image."""
    return (kind, _HEAD.pack(0x92 + len(rest), *_int_head(first)), image,
            _TAIL[len(rest)].pack(*(x for v in rest for x in _int_head(v))))


def scheduled_frame(index: int, scheduler_output: bytes, start_ns: int, schedule_ns: int) -> tuple[bytes, ...]:
    """The frame (kind, payload parts) that says step `index` was scheduled (`SCHEDULED`)."""
    return _array_frame(fp.SCHEDULED, index, scheduler_output, start_ns, schedule_ns)


def output_frame(index: int, model_runner_output: bytes | OutputParts, execute_ns: int,
                 update_ns: int) -> tuple[bytes, ...]:
    """The frame (kind, payload parts) that ends step `index`: `OUTPUT` with the output's image, `OUTPUT_PARTS` with
    its parts."""
    if isinstance(model_runner_output, OutputParts):
        return fp.OUTPUT_PARTS, _ENCODER.encode([index, model_runner_output, execute_ns, update_ns])
    return _array_frame(fp.OUTPUT, index, model_runner_output, execute_ns, update_ns)
