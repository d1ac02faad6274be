"""The capture file: format (records, limits, version), writer, reader (+ damage), recovery."""

from replay.capture.format import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    ChunkInfo,
    EngineConfig,
    Environment,
    Footer,
    Header,
    Index,
    ModelIdentity,
    Record,
    RequestAborted,
    RequestAdded,
    Step,
    StepTiming,
)
from replay.capture.reader import CaptureReader, ChunkRef, Damage
from replay.capture.writer import CaptureWriter

__all__ = [
    "FORMAT_MAJOR", "FORMAT_MINOR", "ChunkInfo", "EngineConfig", "Environment", "Footer", "Header", "Index",
    "ModelIdentity", "Record", "RequestAborted", "RequestAdded", "Step", "StepTiming",
    "CaptureReader", "ChunkRef", "Damage", "CaptureWriter",
]
