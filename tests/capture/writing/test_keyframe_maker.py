"""Keyframes in the writer (format 1.6): where they go, what they hold, and what they cost it."""

from __future__ import annotations

import pytest

from replay.capture import CaptureReader, CaptureWriter, Keyframe, Step
from replay.capture.format.shadow import ShadowTable
from replay.capture.reading.keyframe_seek import chunks_from, keyframe_steps
from replay.capture.reading.recover import recover
from replay.capture.writing.keyframe_maker import KEYFRAME_ENV, keyframe_interval
from replay.errors import UsageError
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events


def _write(path, steps: int, every: int, **kw):
    """A synthetic capture with a keyframe every `every` steps; returns the shadow fed the same events directly,
    sampled after every step (the keyframe of the next step)."""
    shape = SynthShape(steps=steps, running=24, num_logprobs=2, prompt_len=(8, 40), output_len=(4, 30),
                       vocab_size=1000, block_size=16, seed=3)
    header = make_header("synthetic")
    shadow = ShadowTable(header.engine_config.block_size, header.engine_config.enable_prefix_caching)
    expected: dict[int, Keyframe] = {}
    with CaptureWriter(path, header, keyframes=every, **kw) as w:
        for ev in synth_events(shape):
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
                shadow.add_request(ev.request, ev.step)
            else:
                w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
                shadow.step(ev.step, ev.scheduler_output, ev.model_runner_output)
                # the state after this step: the arrivals before the next one follow the keyframe, in its chunk
                expected[ev.step + 1] = shadow.keyframe()
    return expected


def test_a_keyframe_opens_a_chunk_every_n_steps_and_holds_the_shadow_of_that_moment(tmp_path):
    path = tmp_path / "k.capture"
    expected = _write(path, 120, 25)
    with CaptureReader(path) as r:
        assert keyframe_steps(r) == [25, 50, 75, 100]
        chunks = r.index.chunks
        kfs = [rec for rec in r.records() if isinstance(rec, Keyframe)]
    for kf in kfs:
        i = next(i for i, c in enumerate(chunks) if c.keyframe == kf.step)
        assert chunks[i].first_step == kf.step  # the chunk starts where the keyframe stands
        want = expected[kf.step]
        assert kf.requests == want.requests and kf.batch == want.batch and kf.requests
        assert all(r.output_token_ids for r in kf.requests if r.scheduled)


def test_reading_from_a_keyframe_needs_only_its_chunk_onwards(tmp_path):
    path = tmp_path / "k.capture"
    _write(path, 120, 25)
    with CaptureReader(path) as r:
        first = next(chunks_from(r, 75))
        records = list(r.records(chunks=chunks_from(r, 75)))
    assert first.info.keyframe == 75
    assert isinstance(next(x for x in records if isinstance(x, (Keyframe, Step))), Keyframe)
    assert [x.index for x in records if isinstance(x, Step)][0] == 75


def test_no_keyframes_when_asked_for_none_and_a_bad_interval_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "none.capture"
    _write(path, 60, 0)
    assert keyframe_steps(CaptureReader(path)) == []
    monkeypatch.setenv(KEYFRAME_ENV, "often")
    with pytest.raises(UsageError, match=KEYFRAME_ENV):
        keyframe_interval()
    monkeypatch.setenv(KEYFRAME_ENV, "30")
    assert keyframe_interval() == 30 and keyframe_interval(7) == 7
    with pytest.raises(UsageError, match="keyframe interval"):
        keyframe_interval(-1)


def test_recover_writes_the_keyframes_again_where_the_source_had_them(tmp_path):
    path = tmp_path / "k.capture"
    _write(path, 90, 30)
    out = tmp_path / "again.capture"
    recover(path, out)
    with CaptureReader(path) as a, CaptureReader(out) as b:
        ka = [x for x in a.records() if isinstance(x, Keyframe)]
        kb = [x for x in b.records() if isinstance(x, Keyframe)]
    assert [k.step for k in kb] == [30, 60] and kb == ka
