"""Chunks compressed on several threads are written in the order they were sealed, whichever finishes first."""

from __future__ import annotations

import random
import threading
import time

import pytest
import zstandard

from replay.capture import CaptureReader, CaptureWriter, emitter
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
