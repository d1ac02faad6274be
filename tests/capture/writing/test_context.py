"""`with writer:` for both writers (`WriterContext`): an engine error closes the capture with that error as its
status; a capture error stops without a footer, what was written left in NAME.partial for `replay recover`."""

from __future__ import annotations

import pytest

from replay.capture import CaptureReader, CaptureWriter
from replay.capture.writing.writer_process import ProcessCaptureWriter
from replay.contracts import SchedulerOutput
from replay.errors import CaptureError
from replay.provenance import make_header

WRITERS = [pytest.param(CaptureWriter, id="in-process"), pytest.param(ProcessCaptureWriter, id="writer-process")]


@pytest.mark.parametrize("writer", WRITERS)
def test_an_engine_error_closes_with_the_error_as_status(tmp_path, writer):
    path = tmp_path / "err.capture"
    with pytest.raises(RuntimeError):
        with writer(path, make_header("test")) as w:
            w.write_step(0, SchedulerOutput.make_empty(), None)
            raise RuntimeError("engine exploded")
    with CaptureReader(path) as r:
        assert r.complete and [s.index for s in r.steps()] == [0]
        assert r.footer.status.startswith("error: RuntimeError: engine exploded")


@pytest.mark.parametrize("writer", WRITERS)
def test_a_capture_error_stops_without_a_footer(tmp_path, writer):
    path = tmp_path / "lost.capture"
    with pytest.raises(CaptureError):
        with writer(path, make_header("test")) as w:
            w.write_step(0, SchedulerOutput.make_empty(), None)
            raise CaptureError(path, "disk gone")
    assert not path.exists() and w.partial_path.exists()
