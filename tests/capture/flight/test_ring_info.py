"""`replay info RING`: the window a ring's segments hold, its bytes, its snapshots."""

from __future__ import annotations

import threading
import time

import pytest
from typer.testing import CliRunner

from replay.capture import CaptureReader
from replay.capture.flight.control import start_control
from replay.capture.flight.ring_info import is_ring, ring_info
from replay.capture.flight.segments import SegmentRing
from replay.cli import app
from replay.errors import NotACaptureError
from replay.provenance import make_header
from tests.capture.flight.test_segments import SIZE, _events, _feed


def test_a_rings_window_segments_and_snapshots(tmp_path):
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    _feed(ring, _events(1200))
    snap = ring.snapshot("on demand")
    ring.close()
    info = ring_info(tmp_path / "ring")
    assert is_ring(tmp_path / "ring") and not is_ring(tmp_path) and not info.recording
    assert info.size == SIZE and info.first_step > 0 and info.last_step == 1199
    steps = [(s.first_step, s.last_step) for s in info.segments]
    assert all(a[1] + 1 == b[0] for a, b in zip(steps, steps[1:]))  # contiguous
    assert all(s.keyframe == s.first_step for s in info.segments)
    assert info.snapshots == [str(snap)]
    out = CliRunner().invoke(app, ["info", str(tmp_path / "ring")])
    assert out.exit_code == 0
    n = len(info.segments)
    assert f"window    steps {info.first_step}-1199 in {n} closed segment{'s' * (n != 1)}" in out.output
    assert f"steps 0-{info.first_step - 1} were dropped" in out.output and "no recorder is writing it" in out.output
    assert f"of a {SIZE >> 10} KiB ring" in out.output  # in the binary units `--ring` reads its size in
    with pytest.raises(NotACaptureError, match="is a ring's directory, not a capture file: `replay snapshot`"):
        CaptureReader(tmp_path / "ring")  # (what a script that opens it as a capture meets)


def test_asking_whether_a_recorder_runs_seals_nothing(tmp_path):
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    lock = threading.Lock()  # (held while the recording writes, as in the writer process)
    start_control(ring, lock)
    try:
        events = _events(600)
        with lock:
            _feed(ring, [e for e in events if e.step < 300])
        for _ in range(3):
            info = ring_info(tmp_path / "ring")
            assert info.recording
        out = CliRunner().invoke(app, ["info", str(tmp_path / "ring")])
        assert out.exit_code == 0, out.output
        assert "no recorder is writing it" not in out.output
        with lock:
            _feed(ring, [e for e in events if e.step >= 300])
        time.sleep(1.2)  # (the control thread looks at pending requests twice a second)
        assert not list((tmp_path / "ring").rglob("snapshot-*"))  # a probe is no snapshot request
    finally:
        ring.close()
