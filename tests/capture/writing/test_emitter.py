"""Chunks compressed on several threads are written in the order they were sealed, whichever finishes first; the
compiled emitter (`replay.capture._emit`: one C thread, no GIL) writes the same captures."""

from __future__ import annotations

import random
import threading
import time

import pytest
import zstandard

from replay.capture import CaptureReader, CaptureWriter
from replay.capture.writing import emitter
from replay.capture.format import records as fmt
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events


_ZSTD = zstandard.ZstdCompressor


@pytest.fixture
def python_threads(monkeypatch):
    """The Python threads' emitter, whether or not the compiled one loads here."""
    monkeypatch.setattr(emitter, "COMPILED", None)


class _Uneven:
    """A ZstdCompressor whose compress sleeps 0-20 ms at random: later chunks often finish before earlier ones."""

    def __init__(self, **kwargs):
        self._c = _ZSTD(**kwargs)
        self._rng = random.Random(threading.get_ident())

    def compress(self, data: bytes) -> bytes:
        time.sleep(self._rng.random() * 0.02)
        return self._c.compress(data)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_frames_follow_the_seals_whichever_thread_finishes_first(tmp_path, monkeypatch, workers, python_threads):
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


def test_a_writer_behind_its_recording_loop_catches_up_at_the_faster_level(tmp_path, monkeypatch, python_threads):
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


def test_a_writer_that_keeps_up_never_leaves_its_level(tmp_path, monkeypatch, python_threads):
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


needs_compiled = pytest.mark.skipif(emitter.COMPILED is None, reason="no C compiler or no libzstd.so.1 here (or "
                                    "REPLAY_NO_COMPILED=1): the writer keeps its Python threads")


def _frames(path):
    """Every zstd frame of a capture after its prologue, by the index's offsets: (info, frame bytes)."""
    data = path.read_bytes()
    with CaptureReader(path) as r:
        return [(c, data[c.offset:c.offset + c.length]) for c in r.index.chunks]


@needs_compiled
def test_the_compiled_emitter_writes_what_the_python_threads_write(tmp_path, monkeypatch):
    events = list(synth_events(SynthShape(steps=200, running=16, num_logprobs=5, seed=5)))
    header = make_header("test")
    compiled = _record(tmp_path / "c.capture", events, header)
    assert isinstance(compiled._out, emitter.CompiledEmitter)
    monkeypatch.setattr(emitter, "COMPILED", None)
    threads = _record(tmp_path / "p.capture", events, header)
    assert isinstance(threads._out, emitter.ChunkEmitter)
    a, b = _frames(tmp_path / "c.capture"), _frames(tmp_path / "p.capture")
    assert len(a) == len(b) > 20
    dctx = zstandard.ZstdDecompressor()
    for (ia, fa), (ib, fb) in zip(a, b):
        params = zstandard.get_frame_parameters(fa)
        assert params.has_checksum and params.content_size == ia.raw_size  # (as `zstd -dc` and the reader expect)
        assert dctx.decompress(fa) == dctx.decompress(fb)  # the same records, byte for byte
        assert (ia.first_step, ia.num_steps, ia.raw_size) == (ib.first_step, ib.num_steps, ib.raw_size)
    assert [c.offset for c, _ in a] == sorted(c.offset for c, _ in a)
    with CaptureReader(tmp_path / "c.capture") as ra, CaptureReader(tmp_path / "p.capture") as rb:
        assert not ra.damage and list(ra.steps()) == list(rb.steps())


class _Chunk:
    def __init__(self, parts):
        self.parts = parts
        self.info = fmt.ChunkInfo(0, 0, 0, 0)


@needs_compiled
def test_the_compiled_emitter_catches_up_while_chunks_wait_and_writes_them_in_seq_order(tmp_path):
    f = open(tmp_path / "frames", "wb")
    out = emitter.CompiledEmitter(f, level=3, fsync=False, interval=60, idle=lambda: None)
    out.write(b"head")
    bodies = [[f"chunk {i} record {k}".encode() * 50 for k in range(3)] for i in range(6)]
    chunks = [_Chunk(p) for p in bodies]
    seqs = [out.number() for _ in chunks]
    # handed over before the thread starts, and out of order: the thread writes seq 0 first, and finds 5 waiting
    # behind it, then 4, 3, 2 (caught up: >= CATCH_UP_BACKLOG behind), then 1 and 0 behind (its level)
    out._c = emitter.COMPILED.Emitter(f.fileno(), 3, emitter.CATCH_UP_LEVEL, emitter.CATCH_UP_BACKLOG, False,
                                      emitter.DEPTH, 4, 0)
    for seq in reversed(seqs):
        out._sealed[seq] = chunks[seq]
        out._c.submit(seq, chunks[seq].parts, False)
    assert out._c.queued == 6
    f.flush()
    out._c.start()
    out._timer.start()
    out.stop()
    f.close()
    assert out.caught_up == 4 and out.error is None
    data = (tmp_path / "frames").read_bytes()
    assert data[:4] == b"head" and out.bytes_written == len(data)
    assert [c.offset for c in out.chunks] == sorted(c.offset for c in out.chunks) and out.chunks[0].offset == 4
    for c, parts in zip(out.chunks, bodies):
        body = zstandard.ZstdDecompressor().decompress(data[c.offset:c.offset + c.length])
        assert body == bytes([0xDD]) + len(parts).to_bytes(4, "big") + b"".join(parts) and c.raw_size == len(body)


@needs_compiled
def test_the_compiled_emitter_keeps_a_write_error_for_the_recording_thread(tmp_path):
    r, w = __import__("os").pipe()
    __import__("os").close(r)  # writes to the pipe now fail with EPIPE (Python ignores SIGPIPE)
    f = open(w, "wb")
    out = emitter.CompiledEmitter(f, level=3, fsync=False, interval=60, idle=lambda: None)
    out.start()
    out.put(_Chunk([b"x" * 1000]))
    out.put(_Chunk([b"y" * 1000]))  # (after the error: dropped, never waited on)
    out.stop()
    assert isinstance(out.error, OSError) and out.error.errno == 32 and out.chunks == []
    f.close()


@needs_compiled
def test_an_idle_recorder_s_open_chunk_is_sealed_and_written_by_the_compiled_emitter(tmp_path):
    path = tmp_path / "x.capture"
    w = CaptureWriter(path, make_header("test"), flush_interval=0.05)
    assert isinstance(w._out, emitter.CompiledEmitter)
    events = list(synth_events(SynthShape(steps=3, running=2, num_logprobs=None, seed=6)))
    for ev in events:
        if ev.request is not None:
            w.add_request(ev.request, ev.step)
        else:
            w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
    written = w.bytes_written
    deadline = time.monotonic() + 10
    while w.bytes_written == written and time.monotonic() < deadline:  # nothing more is written by the recorder
        time.sleep(0.01)
    assert w.bytes_written > written  # the idle timer sealed the open chunk, the C thread wrote it
    w.close()
    with CaptureReader(path) as r:
        assert [s.index for s in r.steps()] == [ev.step for ev in events if ev.request is None]


@needs_compiled
def test_the_compiled_emitter_with_fsync_writes_a_whole_capture(tmp_path):
    events = list(synth_events(SynthShape(steps=40, running=4, num_logprobs=5, seed=7)))
    w = _record(tmp_path / "x.capture", events, fsync=True)
    assert isinstance(w._out, emitter.CompiledEmitter)
    with CaptureReader(tmp_path / "x.capture") as r:
        assert len(r.index.chunks) > 5 and not r.damage
        assert [s.index for s in r.steps()] == [ev.step for ev in events if ev.request is None]


@needs_compiled
@pytest.mark.parametrize("workers,drain", [(1, 1), (2, 2), (1, 4), (3, 3)])
def test_the_compiled_threads_write_every_chunk_once_in_seq_order(tmp_path, workers, drain):
    # chunks of 0-300 KB, some all one byte (fast to compress), some random (slow), handed over from two Python
    # threads in an order that is not seq order, with back-pressure (depth 3): every frame, once, in seq order
    rng = random.Random(workers * 10 + drain)
    bodies = []
    for i in range(60):
        size = rng.choice([0, 1, 1000, 50_000, 300_000])
        part = bytes([i % 251]) * size if rng.random() < 0.5 else rng.randbytes(size)
        bodies.append([part[: size // 3], part[size // 3:], f"#{i}".encode()])
    f = open(tmp_path / "frames", "wb")
    c = emitter.COMPILED.Emitter(f.fileno(), 3, 1, 2, False, 3, 0, 0, workers, drain)
    c.start()
    order = list(range(len(bodies)))
    halves = [order[0::2], order[1::2]]  # each thread hands over its seqs in order; the two interleave at random

    def hand_over(seqs):
        for seq in seqs:
            c.submit(seq, bodies[seq], True)

    threads = [threading.Thread(target=hand_over, args=(h,)) for h in halves]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c.stop()
    done = c.done()
    f.close()
    assert c.error is None and c.queued == 0
    assert [d[0] for d in done] == order
    data = (tmp_path / "frames").read_bytes()
    at = 0
    for (seq, offset, length, raw, _), parts in zip(done, bodies):
        assert offset == at
        body = zstandard.ZstdDecompressor().decompress(data[offset:offset + length])
        assert body == bytes([0xDD]) + len(parts).to_bytes(4, "big") + b"".join(parts) and raw == len(body)
        at += length
    assert at == len(data)


@needs_compiled
def test_the_compiled_emitter_takes_bytes_like_parts(tmp_path):
    f = open(tmp_path / "frames", "wb")
    out = emitter.CompiledEmitter(f, level=3, fsync=False, interval=60, idle=lambda: None)
    out.start()
    out.put(_Chunk([bytearray(b"abc"), memoryview(b"def"), b"ghi"]))
    out.stop()
    f.close()
    c = out.chunks[0]
    body = zstandard.ZstdDecompressor().decompress((tmp_path / "frames").read_bytes()[c.offset:c.offset + c.length])
    assert body == bytes([0xDD, 0, 0, 0, 3]) + b"abcdefghi"
