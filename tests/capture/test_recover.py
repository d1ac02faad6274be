"""recover: every flushed record survives a crash; damage is named; nothing recoverable is exit 1."""

from __future__ import annotations

import pytest

from replay.capture import CaptureReader, CaptureWriter, Step
from replay.capture.recover import default_output, recover
from replay.errors import NothingRecoverableError, UsageError
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events


def _write_abandoned(path, steps: int) -> list[int]:
    """Write `steps` steps, flush after each, then stop without closing (a crash). Returns steps flushed."""
    w = CaptureWriter(path, make_header("test"))
    flushed = []
    for ev in synth_events(SynthShape(steps=steps, running=4, prompt_len=(4, 8), output_len=(2, 6), seed=3)):
        if ev.request is not None:
            w.add_request(ev.request, ev.step)
        else:
            w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
            w.flush()
            flushed.append(ev.step)
    w.abandon()
    return flushed


def test_unfinished_capture_recovers_every_flushed_step(tmp_path):
    path = tmp_path / "crash.capture"
    flushed = _write_abandoned(path, 12)
    partial = tmp_path / "crash.capture.partial"
    assert default_output(partial) == path
    res = recover(partial)
    assert res.output == str(path) and res.num_steps == len(flushed)
    assert [d.kind for d in res.damage] == ["unfinished"] and res.lost_data
    with CaptureReader(path) as r:
        assert r.complete
        assert [x.index for x in r.records() if isinstance(x, Step)] == flushed
        assert "recovered from crash.capture.partial" in r.footer.status


def test_recovered_steps_equal_the_originals(small_capture, tmp_path):
    out = tmp_path / "copy.capture"
    res = recover(small_capture, out)
    assert not res.lost_data
    with CaptureReader(small_capture) as a, CaptureReader(out) as b:
        sa = [x for x in a.records() if isinstance(x, Step)]
        sb = [x for x in b.records() if isinstance(x, Step)]
    assert sa == sb


def test_damaged_chunk_is_named_and_the_rest_is_kept(small_capture, tmp_path):
    with CaptureReader(small_capture) as r:
        c = r.index.chunks[2]
    data = bytearray(small_capture.read_bytes())
    data[c.offset + c.length // 2] ^= 0x40
    small_capture.write_bytes(bytes(data))
    res = recover(small_capture, tmp_path / "fixed.capture")
    assert [d.chunk for d in res.damage] == [2] and res.lost_data
    assert res.num_steps == 40 - c.num_steps


def test_refuses_to_overwrite(small_capture, tmp_path):
    out = tmp_path / "o.capture"
    recover(small_capture, out)
    with pytest.raises(UsageError, match="already exists"):
        recover(small_capture, out)
    recover(small_capture, out, force=True)
    with pytest.raises(UsageError, match="other than the input"):
        recover(small_capture, small_capture)


def test_nothing_recoverable_when_the_header_is_gone(small_capture, tmp_path):
    cut = tmp_path / "cut.capture"
    cut.write_bytes(small_capture.read_bytes()[:30])
    with pytest.raises(NothingRecoverableError) as e:
        recover(cut)
    assert e.value.exit_code == 1
