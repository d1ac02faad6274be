"""`ring_info`: what a ring directory holds now (`replay info RING`): its window, segments, bytes on disk, snapshots,
and whether a recorder is writing it."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import msgspec

from replay.capture.flight.directory import RingDirectory
from replay.capture.reading.keyframe_seek import keyframe_steps
from replay.capture.reading.reader import CaptureReader
from replay.errors import CaptureError


class SegmentInfo(msgspec.Struct):
    """One closed segment."""

    name: str
    first_step: int
    last_step: int
    bytes: int
    keyframe: int | None  # the step of the keyframe it opens with (None: the first segment, from step 0)


class RingInfo(msgspec.Struct):
    """A ring directory, as `replay info` shows it."""

    path: str
    size: int  # SIZE, as the recorder that wrote it was told (0: unknown)
    recording: bool  # a recorder answers on its control socket
    segments: list[SegmentInfo]
    bytes_on_disk: int  # closed segments and the open one
    first_step: int | None  # the window the closed segments hold
    last_step: int | None
    snapshots: list[str]  # oldest first


def is_ring(path: str | os.PathLike) -> bool:
    """Whether `path` is a ring's directory (what a recorder in ring mode writes)."""
    ring_dir = RingDirectory(path)
    return ring_dir.dir.is_dir() and (ring_dir.writer_info.exists() or bool(ring_dir.segments()))


def ring_info(path: str | os.PathLike) -> RingInfo:
    """Summarise the ring at `path` from its segments' indexes (none is decompressed)."""
    ring_dir = RingDirectory(path)
    segments = []
    for p in ring_dir.segments():
        try:
            with CaptureReader(p) as r:
                span = r.step_span()
                kfs = keyframe_steps(r)
        except CaptureError:
            continue  # (dropped while we looked, or damaged: `info` on the file says which)
        if span is not None:
            segments.append(SegmentInfo(p.name, span[0], span[1], p.stat().st_size, kfs[0] if kfs else None))
    try:
        size = int(json.loads(ring_dir.writer_info.read_text()).get("size", 0))
    except (OSError, ValueError):
        size = 0
    on_disk = sum(p.stat().st_size for p in ring_dir.dir.glob("segment-*") if p.exists())
    snaps = sorted(str(p) for p in ring_dir.snapshots.glob("snapshot-*.capture")) if ring_dir.snapshots.is_dir() else []
    return RingInfo(str(path), size, _answers(ring_dir), segments, on_disk,
                    segments[0].first_step if segments else None, segments[-1].last_step if segments else None,
                    sorted(snaps, key=lambda s: Path(s).stat().st_mtime))


def _answers(ring_dir: RingDirectory) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(ring_dir.control_address())
        return True
    except OSError:
        return False
    finally:
        sock.close()
