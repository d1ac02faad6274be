"""Where a capture's keyframes are (format 1.6), and the chunks a replay from one of them reads."""

from __future__ import annotations

from collections.abc import Iterator

from replay.capture.format.keyframe import Keyframe
from replay.capture.reading.reader import CaptureReader, ChunkRef
from replay.errors import CaptureError


def keyframe_steps(reader: CaptureReader) -> list[int]:
    """The steps the capture's keyframes stand before, in order: from the index, else by reading every record."""
    if reader.index is not None:
        return [c.keyframe for c in reader.index.chunks if c.keyframe >= 0]
    return [rec.step for rec in reader.records() if isinstance(rec, Keyframe)]


def chunks_from(reader: CaptureReader, keyframe: int) -> Iterator[ChunkRef] | None:
    """The chunks from the one that opens with the keyframe of step `keyframe` to the end (None without the index:
    a reader then reads from the start, and the replay skips to the keyframe)."""
    if reader.index is None:
        return None
    chunks = reader.index.chunks
    at = next((i for i, c in enumerate(chunks) if c.keyframe == keyframe), None)
    if at is None:
        raise CaptureError(reader.path, f"no keyframe at step {keyframe}")
    return iter([ChunkRef(i, c.offset, c.offset + c.length, c) for i, c in enumerate(chunks) if i >= at])
