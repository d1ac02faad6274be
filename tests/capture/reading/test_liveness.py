"""A capture without a footer: still being written while its writer holds it (a recorder that outlived its server,
say), or cut short once the writer is gone; and its final name, asked for before it exists, points at it."""

from __future__ import annotations

import time

from replay.capture import CaptureWriter
from replay.capture.reading.liveness import STILL_WRITTEN, being_written
from replay.cli import main
from replay.inspect import capture_info
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events


def test_a_capture_being_written_is_told_from_one_cut_short(tmp_path, capsys):
    path = tmp_path / "live.capture"
    w = CaptureWriter(path, make_header("test"))
    steps = 0
    for ev in synth_events(SynthShape(steps=6, running=3, prompt_len=(4, 8), output_len=(2, 4), seed=1)):
        if ev.request is not None:
            w.add_request(ev.request, ev.step)
        else:
            w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
            steps += 1
    w.flush()
    partial = w.partial_path
    try:
        deadline = time.monotonic() + 30  # (the writer's threads compress and write the chunk)
        while not (partial.stat().st_size and capture_info(partial).num_steps == steps):
            assert time.monotonic() < deadline, "the flushed chunk never reached the file"
            time.sleep(0.05)
        assert being_written(partial)
        assert [d.reason for d in capture_info(partial).damage] == [STILL_WRITTEN]
        assert main(["info", str(partial)]) == 3  # what is on disk is read, and it is not the whole
        out, err = capsys.readouterr()
        assert "not all of it on disk yet:" in out and "capture is still being written" in err, (out, err)
        assert main(["info", str(path)]) == 2
        assert "no such file (live.capture.partial is there: still being written, or cut short" in \
            capsys.readouterr().err
    finally:
        w.abandon()
    assert not being_written(partial)
    [damage] = capture_info(partial).damage
    assert damage.reason.startswith("capture was not closed (the recording stopped)")
