"""`SealQueue` on its own: a seal that fails is said and unpins what it held; a closed queue takes nothing more.
How a ring uses it (the frame loop going on meanwhile, trouble that repeats joining the waiting seal):
test_segments.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from replay.capture.flight.directory import RingDirectory
from replay.capture.flight.sealing import SealQueue
from replay.errors import CaptureError


@dataclass
class _Segment:
    seq: int
    path: Path


def test_a_seal_that_fails_is_said_on_stderr_and_unpins_its_segments(tmp_path, capsys):
    files = RingDirectory(tmp_path / "ring")
    files.create()
    pins: dict[str, int] = {}
    gone = [_Segment(3, tmp_path / "ring" / "segment-000003.capture")]  # (never written)
    queue = SealQueue(files, 4, pins, lambda: gone)
    future = queue.queue("on demand", gone)
    with pytest.raises(CaptureError, match="segment-000003"):
        future.result(timeout=60)
    queue.close()
    assert pins == {} and queue.sealed == [] and len(queue.errors) == 1
    assert "replay: snapshot " in capsys.readouterr().err


def test_a_closed_queue_takes_nothing_and_pins_nothing(tmp_path):
    files = RingDirectory(tmp_path / "ring")
    files.create()
    pins: dict[str, int] = {}
    queue = SealQueue(files, 4, pins, lambda: [])
    queue.close()
    with pytest.raises(RuntimeError):
        queue.queue("on demand", [_Segment(1, tmp_path / "x.capture")])
    assert pins == {}
