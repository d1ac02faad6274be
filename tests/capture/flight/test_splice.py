"""`copy_chunks`: a snapshot joins a ring's segments as the compressed frames they are, and reads as a record-by-record
copy does; a damaged chunk is said and left out; a segment it cannot splice is copied record by record."""

from __future__ import annotations

import time

import msgspec
import pytest

from replay.capture import CaptureReader, CaptureWriter, Footer, Header, Step
from replay.capture.flight.segments import SegmentRing
from replay.capture.flight.snapshot import SnapshotInfo, seal_snapshot
from replay.capture.flight.splice import copy_chunks, splices
from replay.capture.writing.chunk import CopiedChunk
from replay.errors import UsageError
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events
from tests.images import as_map, as_parts

_ENC = msgspec.msgpack.Encoder()


@pytest.fixture(scope="module", params=["steps", "images"])
def segments(request, tmp_path_factory):
    """A ring that wrapped, closed: its segments, oldest first. Its steps as the builtin engine writes them (request
    ids as handles), or as the vLLM tap sends them (images, request ids as strings, logprobs in parts)."""
    d = tmp_path_factory.mktemp("ring")
    ring = SegmentRing(d / "ring", make_header("synthetic"), size=256 << 10, flush_interval=0.01)
    shape = SynthShape(steps=1500, running=32, num_logprobs=2, prompt_len=(16, 64), output_len=(8, 60),
                       vocab_size=151_936, block_size=16, seed=5)
    for ev in synth_events(shape):
        if ev.request is not None:
            ring.add_request(ev.request, ev.step)
        elif request.param == "images":
            ring.write_step_image(ev.step, _ENC.encode(as_map(ev.scheduler_output)), as_parts(ev.model_runner_output))
        else:
            ring.write_record(Step(ev.step, ev.scheduler_output, ev.model_runner_output))
    ring.close()
    assert ring.dropped_before > 0 and len(ring.files.segments()) >= 3
    return ring.files.segments()


def _by_records(segments, out):
    """The window copied record by record (what sealing did before it spliced frames)."""
    with CaptureReader(segments[0]) as r:
        header = r.header
    with CaptureWriter(out, header, keyframes=0) as w:
        for p in segments:
            with CaptureReader(p) as r:
                for rec in r.records(images=True):
                    w.write_record(rec)
    return out


def _records(path):
    with CaptureReader(path) as r:
        recs = list(r.records())
        assert not r.damage
        return recs, r.index


def _info(segments):
    return SnapshotInfo("test", time.time(), "ring", [p.name for p in segments])


def test_a_spliced_snapshot_reads_as_the_records_copied_one_by_one(segments, tmp_path):
    spliced, index = _records(seal_snapshot(segments, tmp_path / "s.capture", _info(segments)))
    copied, copied_index = _records(_by_records(segments, tmp_path / "c.capture"))
    assert [type(x) for x in spliced].count(Header) == 1 and [type(x) for x in spliced].count(Footer) == 1
    body = [x for x in spliced if not isinstance(x, (Header, Footer))]
    assert body == [x for x in copied if not isinstance(x, (Header, Footer))]
    assert index.num_steps == copied_index.num_steps and index.num_requests == copied_index.num_requests
    assert [c.keyframe for c in index.chunks if c.keyframe >= 0] == \
        [c.keyframe for c in copied_index.chunks if c.keyframe >= 0]


def test_a_window_from_step_0_counts_its_requests_once(tmp_path):
    shape = SynthShape(steps=300, running=16, num_logprobs=None, prompt_len=(16, 64), output_len=(8, 60), seed=3)
    with CaptureWriter(tmp_path / "seg.capture", make_header("synthetic"), keyframes=64, chunk_bytes=4096) as w:
        for ev in synth_events(shape):
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
            else:
                w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
    window = [tmp_path / "seg.capture"]
    _, index = _records(seal_snapshot(window, tmp_path / "s.capture", _info(window)))
    _, copied = _records(_by_records(window, tmp_path / "c.capture"))
    assert any(c.keyframe > 0 for c in index.chunks)  # (keyframes later in the window: their requests arrived in it)
    assert index.num_requests == copied.num_requests == sum(c.num_requests_added for c in copied.chunks)


def test_the_segments_chunks_are_copied_as_their_frames(segments, tmp_path):
    out = seal_snapshot(segments, tmp_path / "s.capture", _info(segments))
    with CaptureReader(out) as r:
        frames = {r.frame(ref) for ref in r.iter_chunks()}
    middle = []
    for p in segments:
        with CaptureReader(p) as r:  # (the first chunk holds the header, the last the footer: encoded again)
            middle += [r.frame(ref) for ref in list(r.iter_chunks())[1:-1]]
    assert len(middle) >= len(segments) and all(f in frames for f in middle)


def test_a_damaged_chunk_is_said_and_left_out(segments, tmp_path):
    damaged = [tmp_path / p.name for p in segments]
    for src, dst in zip(segments, damaged):
        dst.write_bytes(src.read_bytes())
    with CaptureReader(damaged[1]) as r:
        ref = list(r.iter_chunks())[2]
        lost_steps = (ref.info.first_step, ref.info.last_step)
    data = bytearray(damaged[1].read_bytes())
    data[ref.end - 6] ^= 0xFF  # inside the frame's last block, before its checksum
    damaged[1].write_bytes(bytes(data))
    out = seal_snapshot(damaged, tmp_path / "s.capture", _info(damaged))
    with CaptureReader(out) as r:
        steps = [s.index for s in r.steps()]
        assert not r.damage
        assert f"lost: {damaged[1].name}: chunk 2" in r.index.status
    assert not set(range(lost_steps[0], lost_steps[1] + 1)) & set(steps)
    assert steps[0] < lost_steps[0] and steps[-1] > lost_steps[1]


def test_a_segment_without_its_index_is_copied_record_by_record(segments, tmp_path):
    cut = tmp_path / segments[0].name
    with CaptureReader(segments[0]) as r:
        end = r.index.chunks[-1].offset + r.index.chunks[-1].length
    cut.write_bytes(segments[0].read_bytes()[:end])  # as a crash leaves it: no index
    with CaptureReader(cut) as r:
        assert not splices(r)
    window = [cut, *segments[1:]]
    spliced, index = _records(seal_snapshot(window, tmp_path / "s.capture", _info(window)))
    copied, copied_index = _records(_by_records(segments, tmp_path / "c.capture"))
    assert [x for x in spliced if isinstance(x, Step)] == [x for x in copied if isinstance(x, Step)]
    assert index.num_requests == copied_index.num_requests  # (its keyframe's requests counted either way)


def test_a_writer_that_makes_keyframes_or_has_later_steps_refuses_a_copied_chunk(segments, tmp_path):
    with CaptureReader(segments[1]) as r:
        ref = list(r.iter_chunks())[1]
        chunk = CopiedChunk(ref.info, frame=r.frame(ref))
        with CaptureWriter(tmp_path / "k.capture", r.header, keyframes=16) as w:
            with pytest.raises(UsageError, match="keyframes"):
                w.write_chunk(chunk)
        with CaptureWriter(tmp_path / "o.capture", r.header, keyframes=0) as w:
            copy_chunks(r, w)
            with pytest.raises(UsageError, match="steps must increase"):
                w.write_chunk(chunk)
    with pytest.raises(ValueError):
        CopiedChunk(ref.info)


def test_a_chunk_whose_records_do_not_decode_is_said_and_left_out(segments, tmp_path):
    """Its checksum holds (what was written was wrong, not what the disk kept): the seal goes on without it."""
    bad = tmp_path / segments[0].name
    with CaptureReader(segments[0]) as r:
        info = msgspec.structs.replace(r.index.chunks[1], num_steps=0, first_step=-1, last_step=-1, keyframe=-1)
        with CaptureWriter(bad, r.header, keyframes=0) as w:
            w.write_chunk(CopiedChunk(info, body=b"\x01"))
            copy_chunks(r, w)
    window = [bad, *segments[1:]]
    out = seal_snapshot(window, tmp_path / "s.capture", _info(window))
    spliced, index = _records(out)
    copied, _ = _records(_by_records(segments, tmp_path / "c.capture"))
    assert f"lost: {bad.name}: chunk 1" in index.status and "do not decode" in index.status
    assert [x for x in spliced if isinstance(x, Step)] == [x for x in copied if isinstance(x, Step)]
