"""The writer process's own side (`writer_child`): how it words a capture the engine left without closing. Its
frames, its sealing after a SIGKILL and its place outside the engine's process tree are tested through the process
that starts it (test_writer_process.py)."""

from __future__ import annotations

from replay.capture.writing.writer_child import stopped_status


def test_a_stop_that_lost_nothing_reads_as_complete():
    assert stopped_status(12) == ("engine stopped: with the engine after step 12 (its process exited, or was stopped "
                                  "with SIGINT/SIGTERM); complete: every record it sent is here")
    assert "before its first step" in stopped_status(-1)


def test_steps_scheduled_and_never_finished_are_named():
    one = stopped_status(7, {8: object()})
    assert one.endswith("; step 8 was running when it stopped (scheduled, never finished: not recorded)")
    many = stopped_status(7, {9: object(), 8: object()})
    assert "; steps 8-9 were running when it stopped" in many


def test_a_record_cut_short_is_said_to_be_dropped():
    status = stopped_status(3, cut=True)
    assert "the one it was sending as it stopped was cut short and dropped" in status
    assert "complete" not in status
