"""`SegmentRing`: a bounded ring of segment captures, and the snapshots it seals, fed a synthetic engine's records.

The same stream is also written as one ordinary capture, the reference: every segment and every snapshot must hold
exactly its steps, and each must start with the keyframe that lets a replay begin there.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from replay.capture import (
    CaptureReader,
    CaptureWriter,
    Crash,
    Keyframe,
    RequestAdded,
    Step,
)
from replay.capture.flight.segments import MARK, SegmentRing
from replay.capture.reading.keyframe_seek import keyframe_steps
from replay.contracts import Array
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events

SIZE = 256 << 10


def _events(steps: int, seed: int = 5):
    shape = SynthShape(steps=steps, running=32, num_logprobs=2, prompt_len=(16, 64), output_len=(8, 60),
                       vocab_size=2000, block_size=16, seed=seed)
    return list(synth_events(shape))


def _feed(ring: SegmentRing, events, reference: CaptureWriter | None = None, each=None) -> None:
    for ev in events:
        if ev.request is not None:
            ring.add_request(ev.request, ev.step)
            if reference is not None:
                reference.add_request(ev.request, ev.step)
        else:
            step = Step(ev.step, ev.scheduler_output, ev.model_runner_output)
            ring.write_record(step)
            if reference is not None:
                reference.write_step_record(step)
            if each is not None:
                each(ev.step)


def _steps(path) -> dict[int, Step]:
    with CaptureReader(path) as r:
        return {s.index: s for s in r.records() if isinstance(s, Step)}


def test_the_ring_stays_within_its_size_and_every_segment_starts_at_a_keyframe(tmp_path):
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    seen = []

    def check(step: int) -> None:
        on_disk = sum(p.stat().st_size for p in ring.files.dir.glob("segment-*"))
        seen.append(on_disk)
        assert on_disk <= SIZE + 2 * ring.segment_bytes, step  # SIZE + the open segment (its chunk in flight)

    ref = CaptureWriter(tmp_path / "ref.capture", make_header("synthetic"), keyframes=0)
    _feed(ring, _events(1500), ref, check)
    ring.close()
    ref.close()
    segments = ring.files.segments()
    assert ring.dropped_before > 0 and len(segments) >= 2  # it wrapped
    want = _steps(tmp_path / "ref.capture")
    for p in segments:
        got = _steps(p)
        first = min(got)
        with CaptureReader(p) as r:
            assert keyframe_steps(r)[0] == first  # a segment opens with its keyframe
        assert all(got[i] == want[i] for i in got)  # the very steps of the stream
    assert max(seen) > SIZE // 2


def test_a_snapshot_joins_the_segments_into_one_capture_that_starts_at_a_keyframe(tmp_path):
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    events = _events(1500)
    # a segment closes on the bytes its compressor threads have written, so when the ring first wraps depends on
    # the machine's pace: feed until it has, then seal
    at = len(events) // 3
    _feed(ring, events[:at])
    while ring.dropped_before == 0 and at < len(events):
        _feed(ring, events[at:at + 1])
        at += 1
    assert ring.dropped_before > 0, "the ring never wrapped"
    path = ring.snapshot("on demand")
    _feed(ring, events[at:])
    ring.close()
    with CaptureReader(path) as r:
        snap = r.header.extra["snapshot"]
        steps = [s.index for s in r.records() if isinstance(s, Step)]
        first_record = next(x for x in r.records() if isinstance(x, (Keyframe, Step)))
    assert steps == list(range(steps[0], steps[-1] + 1)) and steps[0] > 0  # contiguous, the start dropped
    assert isinstance(first_record, Keyframe) and first_record.step == steps[0]
    assert snap["trigger"] == "on demand" and snap["first_step"] == steps[0] and snap["last_step"] == steps[-1]
    assert snap["dropped_before"] == steps[0] and len(snap["segments"]) >= 1


def test_a_crash_seals_a_snapshot_that_ends_with_the_crashing_step(tmp_path):
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    events = [ev for ev in _events(300) if ev.request is not None or ev.step < 200]
    _feed(ring, events)
    crash = Crash(200, "RuntimeError", "planted kernel failure")
    ring.write_crash(crash)
    last = next(ev for ev in _events(300) if ev.request is None and ev.step == 200)
    ring.write_record(Step(200, last.scheduler_output, None))
    ring.close(status=crash.status())
    [snap] = ring.snapshots
    with CaptureReader(snap) as r:
        recs = [x for x in r.records() if isinstance(x, (Crash, Step))]
        assert r.header.extra["snapshot"]["trigger"] == "crash at step 200"
        assert r.index.status == "crashed at step 200: RuntimeError: planted kernel failure"
    assert isinstance(recs[-2], Crash) and recs[-1].index == 200 and recs[-1].model_runner_output is None


def test_an_engine_that_died_outside_a_step_seals_the_window_that_led_there(tmp_path):
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    _feed(ring, _events(300))
    died = "error: the engine died (RuntimeError: Executor failed.)"
    ring.close(status=died)  # (the vLLM tap's status when a worker process died: tests/integrations/vllm)
    [snap] = ring.snapshots
    with CaptureReader(snap) as r:
        assert r.index.status == died and r.step_span()[1] == 299
        assert r.header.extra["snapshot"]["trigger"] == died.removeprefix("error: ")
    for status in ("ok", "error: KeyboardInterrupt: "):  # (stopped by the user: no snapshot)
        other = SegmentRing(tmp_path / status[:2], make_header("synthetic"), size=SIZE, flush_interval=0.01)
        _feed(other, _events(300))
        other.close(status=status)
        assert other.snapshots == []


def test_a_request_the_client_marked_leaves_the_window_from_its_arrival_to_its_finish(tmp_path):
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    events = _events(1200)
    arrivals = [ev for ev in events if ev.request is not None and ev.step > 300]
    marked = arrivals[0].request
    sp = msgspec.structs.replace(marked.sampling_params, extra_args={MARK: True})
    marked = msgspec.structs.replace(marked, sampling_params=sp)
    events = [dataclasses.replace(ev, request=marked) if ev.request is arrivals[0].request else ev
              for ev in events]
    _feed(ring, events)
    ring.close()
    [snap] = [s for s in ring.snapshots if "marked" in s]
    with CaptureReader(snap) as r:
        assert "marked by the client" in r.header.extra["snapshot"]["trigger"]
        recs = list(r.records())
    added = [x.request.request_id for x in recs if isinstance(x, RequestAdded)]
    finished = [s.index for s in recs if isinstance(s, Step)
                and marked.request_id in s.scheduler_output.finished_req_ids]
    assert marked.request_id in added and finished  # its arrival and its finish are both inside


def test_a_nan_in_a_steps_logprobs_seals_a_snapshot(tmp_path):
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    events = _events(200)
    at = next(i for i, ev in enumerate(events) if ev.request is None and ev.step == 120)
    out = events[at].model_runner_output
    vals = out.logprobs.logprobs.to_numpy().copy()
    vals[0, 1] = np.nan
    bad = msgspec.structs.replace(out, logprobs=msgspec.structs.replace(out.logprobs, logprobs=Array.from_numpy(vals)))
    events[at] = dataclasses.replace(events[at], model_runner_output=bad)
    _feed(ring, events)
    ring.close()
    assert any("non-finite logprob at step 120" in CaptureReader(s).header.extra["snapshot"]["trigger"]
               for s in ring.snapshots)


def test_a_waiting_snapshot_pins_the_segments_it_needs(tmp_path):
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    events = _events(1500)
    half = len(events) // 2
    _feed(ring, events[:half])
    req = ring.request(after=400)
    start = ring.last_step
    _feed(ring, events[half:])
    ring.close()
    assert req.done.is_set() and req.path, req.error
    with CaptureReader(req.path) as r:
        steps = [s.index for s in r.records() if isinstance(s, Step)]
    assert steps[0] <= start and steps[-1] >= start + 400  # nothing it needed was dropped while it waited


@pytest.mark.parametrize("keep", [2])
def test_only_the_last_snapshots_are_kept(tmp_path, monkeypatch, keep):
    monkeypatch.setenv("REPLAY_SNAPSHOT_KEEP", str(keep))
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    events = _events(400)
    for part in range(4):
        _feed(ring, events[part * len(events) // 4:(part + 1) * len(events) // 4])
        snap = ring.snapshot("on demand")
        Path(f"{snap}.vllm-replay.log").write_text("a replay's log, beside its snapshot")
    ring.close()
    left = sorted(map(str, ring.files.snapshots.glob("*.capture")))
    # the newest `keep`, as sealed (names sort otherwise: "...-on-demand-2.capture" before "...-on-demand.capture")
    assert len(ring.snapshots) == 4 and left == sorted(ring.snapshots[-keep:])
    logs = sorted(map(str, ring.files.snapshots.glob("*.log")))
    assert logs == sorted(f"{s}.vllm-replay.log" for s in ring.snapshots[-keep:])  # the others' went with them


def test_a_request_finished_with_an_error_seals_a_snapshot_through_the_writer_process(tmp_path):
    from replay.capture.flight.ring_process import ring_writer

    w = ring_writer(tmp_path / "ring", make_header("synthetic"), SIZE)
    events = _events(120)
    for ev in events:
        if ev.request is not None:
            w.add_request(ev.request, ev.step)
        else:
            w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
    w.trigger("request r9 finished with an error")
    w.close()
    [snap] = (tmp_path / "ring" / "snapshots").glob("*error*.capture")
    with CaptureReader(snap) as r:
        assert r.header.extra["snapshot"]["trigger"] == "request r9 finished with an error"
        assert r.step_span() == (0, 119)


def test_the_ring_goes_on_while_a_snapshot_is_sealed_and_keeps_the_segments_it_reads(tmp_path, monkeypatch):
    """Sealing runs beside the frame loop (a 256 MB window takes ~40 s; the engine must not wait on it): steps go on
    being written while it runs, and the segments it reads are not dropped however far the ring goes past its size
    meanwhile. The seal is held here until the rest of the stream is written."""
    release = _hold_seals(monkeypatch)
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    events = _events(1500)
    third = len(events) // 3
    _feed(ring, events[:third])
    ring.trigger("request r1 finished with an error")
    window = [s.path for s in ring.closed]
    first, last = ring.closed[0].first_step, ring.last_step
    _feed(ring, events[third:])  # (with the seal held on the frame loop, this would never return)
    assert ring.last_step > last and not ring.snapshots
    assert all(p.exists() for p in window) and sum(s.size for s in ring.closed) > SIZE  # kept past the ring's size
    release.set()
    ring.close()
    [snap] = ring.snapshots
    assert sorted(_steps(snap)) == list(range(first, last + 1))


def test_trouble_that_repeats_while_a_seal_runs_joins_the_one_waiting(tmp_path, monkeypatch):
    """One seal runs and one waits, however often trouble repeats (a NaN on every step, errors on every step): a
    later trigger joins the waiting seal, whose window grows to the newest segment and whose trigger names both."""
    started = threading.Event()
    release = _hold_seals(monkeypatch, started)
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    events = _events(300)
    _feed(ring, events[:100])
    ring.trigger("request r1 finished with an error")
    assert started.wait(60)
    ring.trigger("request r1 finished with an error")  # the same trigger, the same second: a file of its own
    _feed(ring, events[100:])
    ring.trigger("request r3 finished with an error")
    release.set()
    ring.close()
    first, second = ring.snapshots
    assert first != second and not ring.seal_errors
    with CaptureReader(second) as r:
        assert r.header.extra["snapshot"]["trigger"] == ("request r1 finished with an error; then 1 more: "
                                                         "request r3 finished with an error")
        assert r.step_span()[1] == 299  # the window grew to the last trigger's


def _hold_seals(monkeypatch, started: threading.Event | None = None) -> threading.Event:
    """Seals wait for the returned event (`started` is set as the first begins)."""
    from replay.capture.flight import sealing

    release, real = threading.Event(), sealing.seal_snapshot

    def held(*args, **kwargs):
        if started is not None:
            started.set()
        assert release.wait(120), "never released"
        return real(*args, **kwargs)

    monkeypatch.setattr(sealing, "seal_snapshot", held)
    return release


def test_a_ring_whose_compression_falls_behind_still_rotates_at_its_segment_size(tmp_path, monkeypatch):
    """On a loaded machine the writer's compression threads fall up to DEPTH chunks behind the records: a segment
    rotated on the bytes written so far took every chunk still queued with it (a 64 KiB segment of a server's ring
    grew to 257 KiB). It rotates on the bytes due."""
    from replay.capture.writing.chunk import Chunk

    compress = Chunk.compress

    def slow(self, cctx):
        time.sleep(0.02)  # (a starved thread: the records keep coming)
        return compress(self, cctx)

    monkeypatch.setattr(Chunk, "compress", slow)
    ring = SegmentRing(tmp_path / "ring", make_header("synthetic"), size=SIZE, flush_interval=0.01)
    _feed(ring, _events(600))
    ring.close()
    sizes = [p.stat().st_size for p in ring.files.segments()][:-1]  # (the last one closed early)
    assert len(sizes) >= 2 and max(sizes) <= 1.5 * ring.segment_bytes, (sizes, ring.segment_bytes)
