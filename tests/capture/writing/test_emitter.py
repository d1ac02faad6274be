"""Chunks compressed on several threads are written in the order they were sealed, whichever finishes first; a
recorder that outruns compression catches up at the faster level; an error is kept for the recording thread."""

from __future__ import annotations

import random
import threading
import time

import pytest
import zstandard

from replay.capture import CaptureReader, CaptureWriter
from replay.capture.writing import emitter
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events

_ZSTD = zstandard.ZstdCompressor


class _Uneven:
    """A ZstdCompressor whose compress sleeps 0-20 ms at random: later chunks often finish before earlier ones."""

    def __init__(self, **kwargs):
        self._c = _ZSTD(**kwargs)
        self._rng = random.Random(threading.get_ident())

    def compress(self, data: bytes) -> bytes:
        time.sleep(self._rng.random() * 0.02)
        return self._c.compress(data)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_frames_follow_the_seals_whichever_thread_finishes_first(tmp_path, monkeypatch, workers):
    monkeypatch.setattr(emitter, "WORKERS", workers)
    monkeypatch.setattr(emitter.zstandard, "ZstdCompressor", _Uneven)  # (the writer's index context too)
    events = list(synth_events(SynthShape(steps=120, running=8, num_logprobs=None, seed=3)))
    path = tmp_path / "x.capture"
    with CaptureWriter(path, make_header("test"), chunk_bytes=1_000) as w:
        for ev in events:
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
            else:
                w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
    with CaptureReader(path) as r:
        chunks = r.index.chunks
        assert len(chunks) > 25
        assert [c.offset for c in chunks] == sorted(c.offset for c in chunks)
        steps = [c.first_step for c in chunks if c.num_steps]
        assert steps == sorted(steps)
        got = list(r.steps())
    assert [s.index for s in got] == [ev.step for ev in events if ev.request is None]
    assert [s.model_runner_output.sampled_token_ids for s in got] == \
        [ev.model_runner_output.sampled_token_ids for ev in events if ev.request is None]


class _Levels:
    """A ZstdCompressor that sleeps 5 ms a chunk (a writer slower than its recording loop) and counts the levels
    its chunks were compressed at."""

    levels: list[int] = []

    def __init__(self, **kwargs):
        self._c, self._level = _ZSTD(**kwargs), kwargs["level"]

    def compress(self, data: bytes) -> bytes:
        time.sleep(0.005)
        _Levels.levels.append(self._level)
        return self._c.compress(data)


def _record(path, events, header=None, **options):
    with CaptureWriter(path, header or make_header("test"), chunk_bytes=1_000, **options) as w:
        for ev in events:
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
            else:
                w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
    return w


def test_a_writer_behind_its_recording_loop_catches_up_at_the_faster_level(tmp_path, monkeypatch):
    monkeypatch.setattr(emitter.zstandard, "ZstdCompressor", _Levels)
    events = list(synth_events(SynthShape(steps=120, running=8, num_logprobs=5, seed=4)))
    _Levels.levels = []
    w = _record(tmp_path / "x.capture", events)
    chunk_levels = _Levels.levels[:-1]  # (the last: the index, at the writer's level)
    assert w.chunks_caught_up == chunk_levels.count(emitter.CATCH_UP_LEVEL) > 0
    assert set(chunk_levels) <= {emitter.CATCH_UP_LEVEL, 3}
    _Levels.levels = []
    fixed = _record(tmp_path / "fixed.capture", events, catch_up_level=None)
    assert fixed.chunks_caught_up == 0 and set(_Levels.levels) == {3}
    with CaptureReader(tmp_path / "x.capture") as a, CaptureReader(tmp_path / "fixed.capture") as b:
        assert [c.raw_size for c in a.index.chunks] == [c.raw_size for c in b.index.chunks]  # (the same records)
        assert [s.model_runner_output for s in a.steps()] == [s.model_runner_output for s in b.steps()]


def test_a_writer_that_keeps_up_never_leaves_its_level(tmp_path, monkeypatch):
    monkeypatch.setattr(emitter.zstandard, "ZstdCompressor", _Levels)
    events = list(synth_events(SynthShape(steps=30, running=8, num_logprobs=5, seed=4)))
    _Levels.levels = []

    def drained(w):  # every chunk sealed so far is in the file (the emitter's count of frames written)
        deadline = time.monotonic() + 10
        while w._out._next < w._out._seq and time.monotonic() < deadline:
            time.sleep(0.001)

    with CaptureWriter(tmp_path / "x.capture", make_header("test")) as w:
        drained(w)
        for ev in events:
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
                continue
            w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
            w.flush()  # a chunk a step, each compressed before the next is sealed: never two waiting
            drained(w)
    assert w.chunks_caught_up == 0 and set(_Levels.levels) == {3} and len(_Levels.levels) > 30, _Levels.levels
