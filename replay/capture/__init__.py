"""The capture file: format (records, limits, version), writer, reader, damage, recovery, step ranges."""

from replay.capture.format.keyframe import CachedBlocks, Keyframe, LiveRequest
from replay.capture.format.records import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    ChunkInfo,
    Crash,
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
from replay.capture.reading.damage import Damage
from replay.capture.reading.reader import CaptureReader, ChunkRef
from replay.capture.reading.sets import capture_paths
from replay.capture.reading.step_range import StepRange
from replay.capture.writing.writer import CaptureWriter

__all__ = [
    "FORMAT_MAJOR", "FORMAT_MINOR", "CachedBlocks", "ChunkInfo", "Crash", "Keyframe", "LiveRequest", "EngineConfig",
    "Environment", "Footer", "Header", "Index",
    "ModelIdentity", "Record", "RequestAborted", "RequestAdded", "Step", "StepTiming",
    "CaptureReader", "ChunkRef", "Damage", "CaptureWriter", "StepRange", "capture_paths",
]
