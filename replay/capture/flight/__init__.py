"""Always on (DESIGN §9): a bounded flight recorder. A ring of capture segments, each opening with a keyframe, the
oldest dropped past a size; snapshots that seal a window of it into one capture, on demand or on trouble."""

from replay.capture.flight.layout import RING_ENV, RingLayout, parse_size
from replay.capture.flight.segments import SegmentRing

__all__ = ["RING_ENV", "RingLayout", "SegmentRing", "parse_size"]
