"""Always on (docs/design.md, "The flight recorder"): a bounded flight recorder. A ring of capture segments, each
opening with a keyframe, the
oldest dropped past a size; snapshots that seal a window of it into one capture, on demand or on trouble."""

from replay.capture.flight.directory import RING_ENV, RingDirectory, parse_size
from replay.capture.flight.segments import SegmentRing

__all__ = ["RING_ENV", "RingDirectory", "SegmentRing", "parse_size"]
