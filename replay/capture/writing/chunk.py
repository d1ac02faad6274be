"""`Chunk`: the records a writer gathers before they are compressed into one frame, with their index entry."""

from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING

import msgspec

from replay.capture.codec.columns import ColumnSink
from replay.capture.codec.outline import ImageOutline
from replay.capture.format import records as fmt
from replay.capture.writing.image_batch import PartsBatch
from replay.errors import UsageError

if TYPE_CHECKING:
    import zstandard

    from replay.contracts.image_decoder import ImageDecoder

_ARRAY32 = 0xDD  # msgpack array 32 header: lets us prepend the count of records once a chunk is sealed


def encode_record(record: msgspec.Struct) -> bytes:
    """A record as a chunk stores it; UsageError, naming the record, for one msgpack cannot hold or over the limit."""
    try:
        data = fmt.WIRE_ENCODER.encode(record)
        if len(data) <= fmt.MAX_RECORD_BYTES:
            return data
        why = f"a record of {len(data)} bytes exceeds the {fmt.MAX_RECORD_BYTES}-byte limit"
    except (TypeError, OverflowError, msgspec.EncodeError) as e:  # e.g. an int beyond 64 bits in extra_args
        why = str(e)
    raise UsageError(f"cannot record a {'Step' if isinstance(record, fmt.Step) else type(record).__name__}: {why}")


def chunk_body(parts: list[bytes]) -> bytes:
    """A chunk's uncompressed bytes: its records as one msgpack array."""
    return struct.pack(">BI", _ARRAY32, len(parts)) + b"".join(parts)


class Chunk:
    """Encoded records waiting to be compressed, plus the stats the index keeps for them, and the logprob matrices
    of its steps (`columns`), which become its first record when it is sealed."""

    __slots__ = ("parts", "raw", "info", "born", "columns", "batch", "declared", "folds")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.raw = 0
        self.info = fmt.ChunkInfo(0, 0, 0, 0)
        self.born = time.monotonic()
        self.columns = ColumnSink()
        self.batch = PartsBatch()  # its image steps with outputs in parts (None in `parts` until sealed)
        self.declared = False  # whether its first step's LiveIds is written (format 1.5)
        # its records for the keyframe shadow, in order (another engine's steps as `ImageOutline`s)
        self.folds: list = []

    def seal(self, decoder: ImageDecoder | None) -> None:
        """Finish the steps set aside, then put the chunk's logprob columns first (format 1.3): a reader meets them
        before the steps that use them."""
        if len(self.batch):
            records, generated = self.batch.finish(self.columns, decoder)
            done = iter(records)
            self.parts = [p if p is not None else next(done) for p in self.parts]
            self.info.num_generated_tokens += generated
        record = self.columns.seal()
        if record is not None:
            data = fmt.WIRE_ENCODER.encode(record)
            self.parts.insert(0, data)
            self.raw += len(data)
            self.info.num_records += 1
            self.folds = [f._replace(part=f.part + 1) if isinstance(f, ImageOutline) else f for f in self.folds]

    def compress(self, cctx: zstandard.ZstdCompressor) -> tuple[bytes, int]:
        """(its zstd frame, its uncompressed size), for the emitter's threads."""
        body = chunk_body(self.parts)
        return cctx.compress(body), len(body)


class CopiedChunk:
    """A chunk of another capture (`info`: its index entry, copied): its zstd `frame` as it was stored, or, where
    some of its records had to go (a header, a footer: the new capture's own), the `body` left to compress."""

    __slots__ = ("info", "frame", "body")

    def __init__(self, info: fmt.ChunkInfo, *, frame: bytes | None = None, body: bytes | None = None) -> None:
        if (frame is None) == (body is None):
            raise ValueError("a copied chunk is either its frame or its body")
        self.info = info
        self.frame = frame
        self.body = body

    def compress(self, cctx: zstandard.ZstdCompressor) -> tuple[bytes, int]:
        """(its frame, its uncompressed size): the frame as it came, else its body compressed now."""
        if self.frame is not None:
            return self.frame, self.info.raw_size
        return cctx.compress(self.body), len(self.body)
