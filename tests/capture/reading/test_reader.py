"""Reader robustness: truncation, bit flips, unknown records, versions, limits, missing index."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import msgspec
import pytest
import zstandard

from replay.capture import CaptureReader, CaptureWriter, Step
from replay.capture.format import records as fmt
from replay.capture.format.frames import parse_frame, skippable_frame
from replay.errors import (
    CaptureError,
    HeaderLostError,
    LimitExceededError,
    NotACaptureError,
    UnsupportedVersionError,
)
from replay.provenance import make_header
from replay.record.synth import SynthShape, record_synth

# Written by this project's writer at commit 178bae1 (format 1.3: steps as `PackedStep`) with `record_synth` of
# FORMAT_1_3_SHAPE; the writer now stores the same steps as 1.4 `AlignedStep`s.
FORMAT_1_3 = Path(__file__).parent / "data" / "format-1.3-synth.capture"
FORMAT_1_3_SHAPE = SynthShape(steps=40, running=8, num_logprobs=3, prompt_len=(8, 40), output_len=(3, 12))


def read_all(path):
    """(step indices read, damage) of a capture, reading leniently."""
    with CaptureReader(path) as r:
        steps = [rec.index for rec in r.records() if isinstance(rec, Step)]
        return steps, list(r.damage)


def chunk_extents(path):
    """(start, end) of every data chunk, from the seek index."""
    with CaptureReader(path) as r:
        return [(c.offset, c.offset + c.length, c) for c in r.index.chunks]


def test_clean_capture_reads_completely(small_capture):
    steps, damage = read_all(small_capture)
    assert steps == list(range(40)) and damage == []
    assert len(chunk_extents(small_capture)) > 5  # the fixture really spans many chunks


def test_truncated_capture_recovers_every_whole_chunk(small_capture, tmp_path):
    data = small_capture.read_bytes()
    extents = chunk_extents(small_capture)
    index_at = struct.unpack_from("<Q", data, len(data) - 16)[0]
    cut_path = tmp_path / "cut.capture"
    # Every offset within 24 bytes of a frame boundary (prologue, each chunk, the index and its trailer), where what
    # is readable changes, and a fixed sample of the offsets inside frames, where it does not (every offset took
    # 46 s of the suite for the same verdicts)
    edges = {0, len(data), index_at, len(data) - 16} | {x for start, end, _ in extents for x in (start, end)}
    near = {c for e in edges for c in range(e - 24, e + 25) if 0 <= c <= len(data)}
    cuts = sorted(near | set(random.Random(11).sample(range(len(data) + 1), min(400, len(data) + 1))))
    prev = -1
    for cut in cuts:
        cut_path.write_bytes(data[:cut])
        try:
            steps, damage = read_all(cut_path)
        except CaptureError:  # the package's own error type is the only thing allowed to escape
            steps, damage = [], None
        n = len(steps)
        assert n >= prev, f"cut at {cut}: {n} steps, fewer than the {prev} at the previous offset"
        prev = n
        whole = [c for start, end, c in extents if end <= cut]
        expected = sorted(i for c in whole if c.num_steps for i in range(c.first_step, c.last_step + 1))
        assert steps[: len(expected)] == expected, f"cut at {cut}: a complete chunk was not recovered"
        if cut < index_at:  # past it only the (derived) index is missing: no record is lost
            assert damage is None or damage, f"cut at {cut}: truncation not reported"
    assert prev == 40


def test_flipped_byte_is_reported_with_its_chunk_and_other_chunks_still_read(small_capture, tmp_path):
    data = bytearray(small_capture.read_bytes())
    extents = chunk_extents(small_capture)
    victim = 3
    start, end, info = extents[victim]
    data[(start + end) // 2] ^= 0x10
    bad = tmp_path / "flipped.capture"
    bad.write_bytes(bytes(data))
    steps, damage = read_all(bad)
    assert [d.chunk for d in damage] == [victim]
    assert damage[0].first_step == info.first_step and damage[0].last_step == info.last_step
    lost = set(range(info.first_step, info.last_step + 1))
    assert steps == [i for i in range(40) if i not in lost]


def test_flipped_byte_without_index_is_found_by_the_linear_scan(small_capture, tmp_path):
    data = small_capture.read_bytes()
    index_at = struct.unpack_from("<Q", data, len(data) - 16)[0]
    data = bytearray(data[:index_at])  # as after a crash: no index
    start, end, _ = chunk_extents(small_capture)[1]
    data[start + 6] ^= 0x01  # a block header: the frame's extent itself is now wrong
    bad = tmp_path / "flipped.capture.partial"
    bad.write_bytes(bytes(data))
    steps, damage = read_all(bad)
    assert any(d.chunk == 1 for d in damage)
    assert steps and steps[-1] == 39  # resynchronised on the next chunk


def test_unknown_record_tag_is_skipped(tmp_path):
    class FromTheFuture(msgspec.Struct, tag="telemetry", array_like=True):
        payload: str

    path = tmp_path / "future.capture"
    w = CaptureWriter(path, make_header("test"))
    w.abort_request("r1", 0)
    w._append([fmt.WIRE_ENCODER.encode(FromTheFuture("hello"))])
    w.abort_request("r2", 1)
    w.close()
    with CaptureReader(path) as r:
        recs = list(r.records())
        assert r.unknown_records == 1 and r.damage == []
    assert [type(x).__name__ for x in recs] == ["Header", "RequestAborted", "RequestAborted", "Footer"]


def _tags(path) -> list[str]:
    with CaptureReader(path) as r:
        return [fmt.WIRE_DECODER.decode(raw).__struct_config__.tag for ref in r.iter_chunks()
                for raw in fmt.CHUNK_DECODER.decode(r.read_chunk_bytes(ref))]


def test_a_format_1_3_capture_reads_as_the_records_this_writer_writes_now(tmp_path):
    new = record_synth(tmp_path / "new.capture", FORMAT_1_3_SHAPE)
    assert _tags(FORMAT_1_3).count("packed_step") == 39 and _tags(new).count("aligned_step") == 40
    got = []
    for path in (FORMAT_1_3, new):
        with CaptureReader(path) as r:
            got.append([rec for rec in r.records() if not isinstance(rec, (fmt.Header, fmt.Footer))])
            assert r.damage == [] and r.unknown_records == 0
    assert len(got[0]) == 92 and got[0] == got[1]


def _rewrite_prologue(path, major, minor):
    data = bytearray(path.read_bytes())
    struct.pack_into("<HH", data, 16, major, minor)
    path.write_bytes(bytes(data))


def test_newer_major_version_is_refused_naming_both_versions(small_capture):
    _rewrite_prologue(small_capture, fmt.FORMAT_MAJOR + 1, 4)
    with pytest.raises(UnsupportedVersionError) as e:
        CaptureReader(small_capture)
    assert f"{fmt.FORMAT_MAJOR + 1}.4" in str(e.value) and f"{fmt.FORMAT_MAJOR}.x" in str(e.value)
    assert e.value.exit_code == 2


def test_newer_minor_version_is_read(small_capture):
    _rewrite_prologue(small_capture, fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR + 3)
    steps, damage = read_all(small_capture)
    assert len(steps) == 40 and damage == []


def test_frame_claiming_huge_size_is_refused_without_allocating(tmp_path):
    # A hand-made zstd frame header claiming 2**40 decompressed bytes (single segment, 8-byte content size).
    bomb = struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", 1 << 40) + bytes([1, 0, 0])
    assert parse_frame(bomb, 0).content_size == 1 << 40
    prologue = skippable_frame(fmt.PROLOGUE_MAGIC, fmt.PROLOGUE_ID + struct.pack("<HH", 1, 0))
    path = tmp_path / "bomb.capture"
    path.write_bytes(prologue + bomb)
    with pytest.raises(HeaderLostError, match="limit"):
        CaptureReader(path)


def test_oversize_record_is_refused(tmp_path):
    from replay.contracts import CachedRequestData, NewRequestData, SchedulerOutput

    path = tmp_path / "big.capture"
    with CaptureWriter(path, make_header("test")) as w:
        big = NewRequestData("r", list(range(5000)), [], None, None, ([0],), 0, None)
        w.write_step(0, SchedulerOutput([big], CachedRequestData.make_empty(), {"r": 5000}, 5000, {}, {}, set(), []),
                     None)
        w.write_step(1, SchedulerOutput.make_empty(), None)
    with CaptureReader(path, max_record_bytes=4096) as r:
        steps = [rec.index for rec in r.records() if isinstance(rec, Step)]
        assert steps == [] or 0 not in steps
        assert any("over the 4096-byte limit" in d.reason for d in r.damage)


def test_oversize_chunk_is_refused_before_decompression(small_capture):
    with CaptureReader(small_capture) as r:  # the header records this process's environment: its size varies
        limit = max(1000, next(r.iter_chunks()).info.raw_size)
    with CaptureReader(small_capture, max_frame_bytes=limit) as r:  # the header chunk fits, others do not
        refs = list(r.iter_chunks())
        over = next(ref for ref in refs if ref.info.raw_size > limit)
        with pytest.raises(LimitExceededError, match=f"over the {limit}-byte limit"):
            r.read_chunk_bytes(over)
        big = [ref.number for ref in refs if ref.info.raw_size > limit]
        steps = [rec.index for rec in r.records() if isinstance(rec, Step)]
        assert sorted(d.chunk for d in r.damage) == big
        small = [ref.info for ref in refs if ref.info.raw_size <= limit and ref.info.num_steps]
        assert steps == [i for c in small for i in range(c.first_step, c.last_step + 1)]


def test_step_lookup_through_the_index_decompresses_one_chunk(small_capture, monkeypatch):
    with CaptureReader(small_capture) as r:
        calls = []
        real = r._decompress
        monkeypatch.setattr(r, "_decompress", lambda ref: calls.append(ref.number) or real(ref))
        assert r.step(33).index == 33
        assert len(calls) == 1
        with pytest.raises(CaptureError, match="no step 99"):
            r.step(99)


def test_missing_index_falls_back_to_linear_scan(small_capture, tmp_path):
    data = small_capture.read_bytes()
    index_at = struct.unpack_from("<Q", data, len(data) - 16)[0]
    p = tmp_path / "noindex.capture"
    p.write_bytes(data[:index_at])
    with CaptureReader(p) as r:
        assert r.index is None
        assert r.step(17).index == 17
        steps = [rec.index for rec in r.records() if isinstance(rec, Step)]
        assert steps == list(range(40))
        assert r.damage == []  # the footer was read: nothing but the index is missing


def test_damaged_index_is_reported_and_scanned_around(small_capture):
    data = bytearray(small_capture.read_bytes())
    data[-30] ^= 0xFF  # inside the index payload: crc mismatch
    small_capture.write_bytes(bytes(data))
    steps, damage = read_all(small_capture)
    assert steps == list(range(40))
    assert [d.kind for d in damage] == ["index"]


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "empty file"),
        (b"hello world\n", "not a replay capture"),
        (zstandard.ZstdCompressor().compress(b"[1,2,3]"), "plain zstd file"),
    ],
)
def test_not_a_capture(tmp_path, content, reason):
    p = tmp_path / "x.capture"
    p.write_bytes(content)
    with pytest.raises(NotACaptureError, match=reason):
        CaptureReader(p)


def test_reader_never_leaks_foreign_exceptions_on_random_bytes(tmp_path):
    import random

    rnd = random.Random(1234)
    prologue = skippable_frame(fmt.PROLOGUE_MAGIC, fmt.PROLOGUE_ID + struct.pack("<HH", 1, 0))
    p = tmp_path / "r.capture"
    for i in range(300):
        body = bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 200)))
        if i % 2:
            body = struct.pack("<I", 0xFD2FB528) + body
        p.write_bytes(prologue + body)
        try:
            with CaptureReader(p) as r:
                list(r.records())
        except CaptureError:
            pass


def test_a_chunk_whose_frame_magic_is_gone_is_reported_by_the_linear_scan(small_capture, tmp_path):
    data = bytearray(small_capture.read_bytes())
    index_at = struct.unpack_from("<Q", data, len(data) - 16)[0]
    lost = chunk_extents(small_capture)[5][2]
    data[lost.offset:lost.offset + 4] = b"JUNK"  # the scan cannot find this frame: its steps are gone
    p = tmp_path / "noindex.capture"
    p.write_bytes(bytes(data[:index_at]))
    steps, damage = read_all(p)
    gone = set(range(lost.first_step, lost.last_step + 1))
    assert gone and not gone & set(steps)
    assert ("garbage", lost.offset) in [(d.kind, d.offset) for d in damage]


def test_a_malformed_record_loses_itself_not_its_chunk(tmp_path):
    """A record framed and checksummed but not of its types (a writer that stored a float where the contract says
    int: here a step's computed-token count) is damage of that record alone; the chunk's other records read."""
    from replay.record.synth import synth_events

    events = list(synth_events(SynthShape(steps=30, running=4, num_logprobs=None, seed=2)))
    steps = [ev for ev in events if ev.request is None]
    bad = steps[12]
    cr = bad.scheduler_output.scheduled_cached_reqs
    assert cr.num_computed_tokens  # (a decode step: its cached requests' counts)
    bad_so = msgspec.structs.replace(bad.scheduler_output, scheduled_cached_reqs=msgspec.structs.replace(
        cr, num_computed_tokens=[float(cr.num_computed_tokens[0])] + list(cr.num_computed_tokens[1:])))
    path = tmp_path / "x.capture"
    with CaptureWriter(path, make_header("test")) as w:
        for ev in events:
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
            else:
                w.write_step(ev.step, bad_so if ev is bad else ev.scheduler_output, ev.model_runner_output)
    with CaptureReader(path) as r:
        assert len(r.index.chunks) == 2  # (the header's, then every record above in one chunk)
        got = [s.index for s in r.steps()]
        assert got == [ev.step for ev in steps if ev is not bad]
        (d,) = r.damage
        assert (d.kind, d.chunk, d.first_step, d.last_step) == ("record", 1, bad.step, bad.step)
        assert "malformed" in d.reason and "int" in d.reason
        assert sum(isinstance(x, fmt.RequestAdded) for x in r.records()) == sum(ev.request is not None for ev in events)


def test_a_chunk_that_does_not_declare_its_handles_is_damage_not_another_chunks_ids(tmp_path):
    """From format 1.5 every chunk declares the handles its steps use, so a chunk is read with its own ids only: one
    whose declarations are missing reports its steps as damage rather than resolving them through the chunk
    before it (each capture numbers its handles from 0: a snapshot joins chunks of several)."""
    from replay.capture.writing.chunk import CopiedChunk, chunk_body

    src = record_synth(tmp_path / "src.capture", SynthShape(steps=80, running=6, seed=2), chunk_bytes=3000)
    with CaptureReader(src) as r:
        refs = [ref for ref in r.iter_chunks() if ref.info.num_steps]
        first, later = refs[0], refs[1]  # (requests live in both: the first one's table would resolve the second)
        raws = fmt.CHUNK_DECODER.decode(r.read_chunk_bytes(later))
        undeclared = [x for x in raws if not bytes(x).startswith((b"\x93\xa3ids", b"\x93\xa8live_ids"))]
        assert len(undeclared) < len(raws)
        with CaptureWriter(tmp_path / "x.capture", r.header, keyframes=0) as w:
            w.write_chunk(CopiedChunk(msgspec.structs.replace(first.info), frame=r.frame(first)))
            info = msgspec.structs.replace(later.info, num_records=len(undeclared))
            w.write_chunk(CopiedChunk(info, body=chunk_body(undeclared)))
    with CaptureReader(tmp_path / "x.capture") as r:
        steps = [s.index for s in r.steps()]
        assert steps == list(range(first.info.first_step, first.info.last_step + 1))
        assert {d.first_step for d in r.damage} == set(range(later.info.first_step, later.info.last_step + 1))
        assert "no readable record declares" in r.damage[0].reason
