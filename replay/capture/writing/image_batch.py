"""Image steps whose outputs came in parts (`OutputParts`, the vLLM tap's common step), finished per chunk.

Why: the writer process's Python per step is most of the tap's CPU (docs/performance.md, "The real vLLM tap").
When a step is written, only its SchedulerOutput's head is read and its
parts' lengths checked; its matrices' bytes are set aside as they are (`ColumnSink.take_bytes`: no numpy per step).
The rest of what its record needs (whether its sampled tokens repeat the logprob rows' column 0, the markers into
the chunk's columns, the record's bytes) is decided when the chunk is sealed, on the chunk's joined matrices. The
stored records are those `store_step_image` makes, byte for byte; crash safety is unchanged, since the open chunk
lived in memory anyway.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import numpy as np

from replay.capture.codec.columns import ColumnSink, markers
from replay.capture.codec.step_image import (
    NIL,
    SCHEDULE,
    OutputParts,
    count_tokens,
    is_nil,
    one_token_each,
    tokens_in_column_0,
)
from replay.capture.format import records as fmt
from replay.contracts.image_decoder import ImageDecoder

_ENCODER = msgspec.msgpack.Encoder()
_WELL_FORMED = msgspec.msgpack.Decoder(tuple[msgspec.Raw, msgspec.Raw])
_MARGIN = 4096  # a record's bytes beyond its images: envelope, timing, markers, the tokens' reference (~300 B)


class _Pending(NamedTuple):
    index: int
    scheduler_output: bytes
    parts: OutputParts
    grammar_output: bytes | None
    timing: fmt.StepTiming | None
    group: int  # where its logprob rows are in the chunk's columns
    row: int


class PartsBatch:
    """The open chunk's image steps with outputs in parts, waiting for the chunk's seal to be finished together."""

    __slots__ = ("_steps",)

    def __init__(self) -> None:
        self._steps: list[_Pending] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, index: int, scheduler_output: bytes, parts: OutputParts, grammar_output: bytes | None,
            timing: fmt.StepTiming | None, columns: ColumnSink) -> int | None:
        """Set a step aside; its scheduled-token count, or None for a step `store_step_image` must store now (drafts
        to count, matrices the columns do not take). Raises msgspec.DecodeError for images that are not msgpack,
        ValueError for parts inconsistent in themselves."""
        if len(scheduler_output) + len(parts.rest) + len(parts.tokens) + _MARGIN > fmt.MAX_RECORD_BYTES:
            return None  # the step-by-step route measures it exactly (and refuses it by name if it is too large)
        head = SCHEDULE.decode(scheduler_output)
        if len(head.scheduled_spec_decode_tokens) > 1 or not parts.rest or not 0x80 <= parts.rest[0] <= 0x8F:
            return None  # drafts are counted on the whole image; a long map is rare (store_step_image handles it)
        _WELL_FORMED.decode(b"\x92" + parts.rest + parts.tokens)  # what joins the record must be msgpack (a skim)
        where = columns.take_bytes(tuple(parts.dtypes), tuple(parts.shape), tuple(parts.arrays))
        if where is None:
            return None
        self._steps.append(_Pending(index, scheduler_output, parts, grammar_output, timing, *where))
        return head.total_num_scheduled_tokens

    def finish(self, columns: ColumnSink, decoder: ImageDecoder) -> tuple[list[bytes], int]:
        """The steps' records, encoded, in the order they came, and their generated tokens; the batch is empty
        afterwards. Call it before `columns.seal()`: it reads the column groups' sampled tokens."""
        steps, self._steps = self._steps, []
        ids = {g: columns.token_ids(g) for g in {s.group for s in steps}}
        each: dict[int, tuple[bytes, list[int]] | None] = {}  # the Python check's per-group images, made if needed
        records, generated = [], 0
        for s in steps:
            n = s.parts.shape[0]
            if _one_token_a_row(s, n, ids[s.group], each):
                reference, count = one_token_each(n), n
            else:
                reference, count = _other_form(s, ids[s.group][s.row:s.row + n, 0].tolist(), decoder)
            generated += count
            lp = markers(tuple(s.parts.dtypes), tuple(s.parts.shape), s.group, s.row, s.parts.cu_num_generated_tokens)
            image = s.parts.image(bytes(reference), _ENCODER.encode(lp))
            go = NIL if is_nil(s.grammar_output) else msgspec.Raw(s.grammar_output)
            records.append(fmt.WIRE_ENCODER.encode(fmt.StepImage(s.index, msgspec.Raw(s.scheduler_output),
                                                                  msgspec.Raw(image), go, s.timing)))
        return records, generated


def one_token_each_images(column_0: np.ndarray) -> tuple[bytes, list[int]] | None:
    """The msgpack images of `[t]` for every token `t` of `column_0`, joined, and where each starts (one offset
    more than tokens): what a step's sampled tokens are when it sampled its logprob rows' column 0, one token a
    row, as msgspec encodes them (each int in its narrowest form). Made once per chunk, so that a step's check
    is a comparison of bytes, not a list built and encoded. None when a token is
    negative or beyond 32 bits (the step-by-step check handles those)."""
    v = column_0.astype(np.int64)
    if v.size and (v.min() < 0 or v.max() >= 1 << 32):
        return None
    width = np.select([v < 128, v < 256, v < 1 << 16], [1, 2, 3], 5)  # fixint, uint8, uint16, uint32
    offsets = np.zeros(len(v) + 1, np.int64)
    np.cumsum(width + 1, out=offsets[1:])
    out = np.zeros(int(offsets[-1]), np.uint8)
    at = offsets[:-1]
    out[at] = 0x91  # a one-element array
    for w, marker, size in ((1, None, 1), (2, 0xCC, 1), (3, 0xCD, 2), (5, 0xCE, 4)):  # size: the value's bytes
        sel = width == w
        where, x = at[sel] + 1, v[sel]
        if marker is not None:
            out[where] = marker
            where = where + 1
        for i in range(size):  # big-endian
            out[where + i] = (x >> (8 * (size - 1 - i))) & 0xFF
    return out.tobytes(), offsets.tolist()


def _one_token_a_row(s: _Pending, n: int, ids: np.ndarray, each: dict) -> bool:
    """Whether the step sampled its logprob rows' column 0, one token a row: a comparison of its tokens' image with
    the chunk's images of `[t]`."""
    if s.group not in each:
        each[s.group] = one_token_each_images(ids[:, 0])
    return _repeats_column_0(s.parts.tokens, each[s.group], s.row, n, ids)


def _array_head(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4,
                                                                                                                    "big")


def _repeats_column_0(tokens: bytes, each: tuple[bytes, list[int]] | None, row: int, n: int, ids: np.ndarray) -> bool:
    """Whether a step's sampled-tokens image is `[[t] for t in column 0]` of its rows `row..row+n`."""
    if each is None:
        return tokens == _ENCODER.encode(ids[row:row + n, :1].tolist())
    images, offsets = each
    head, seen = _array_head(n), memoryview(tokens)
    a, b = offsets[row], offsets[row + n]
    return len(seen) == len(head) + b - a and seen[:len(head)] == head and seen[len(head):] == memoryview(images)[a:b]


def _other_form(s: _Pending, column_0: list[int], decoder: ImageDecoder) -> tuple[bytes, int]:
    """A step whose sampled tokens are not one per logprob row: the reference (or its tokens as they came) and
    their count, as `store_step_image` decides them. Tokens of another shape that cannot be counted are kept as
    the engine sent them, counted as none: the seek index's count is a figure, the bytes are the record."""
    try:
        reference, count = tokens_in_column_0(msgspec.Raw(s.parts.tokens), column_0)
        if reference is not None:
            return reference, count
        image = s.parts.image(s.parts.tokens, b"\xc0")  # (no logprobs: only the tokens are counted)
        return s.parts.tokens, count_tokens(msgspec.Raw(s.parts.tokens), image, decoder)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return s.parts.tokens, 0
