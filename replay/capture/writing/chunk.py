"""`Chunk`: the records a writer gathers before they are compressed into one frame, with their index entry."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from replay.capture.codec.columns import ColumnSink
from replay.capture.codec.outline import ImageOutline
from replay.capture.format import records as fmt
from replay.capture.writing.image_batch import PartsBatch

if TYPE_CHECKING:
    from replay.contracts.image_decoder import ImageDecoder


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
