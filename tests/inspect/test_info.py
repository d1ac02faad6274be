"""info: numbers match what is in the file, with and without the index."""

from __future__ import annotations

import struct

from replay.capture import CaptureReader, RequestAdded, Step
from replay.inspect import capture_info


def _truth(path):
    with CaptureReader(path) as r:
        recs = list(r.records())
    steps = [x for x in recs if isinstance(x, Step)]
    gen = sum(len(t) for s in steps for t in s.model_runner_output.sampled_token_ids)
    sched = sum(s.scheduler_output.total_num_scheduled_tokens for s in steps)
    ids = {rid for s in steps for rid in s.scheduler_output.num_scheduled_tokens}
    return len(steps), gen, sched, len(ids), sum(isinstance(x, RequestAdded) for x in recs)


def test_info_from_the_index(small_capture):
    info = capture_info(small_capture)
    steps, gen, sched, ids, added = _truth(small_capture)
    assert (info.num_steps, info.num_generated_tokens, info.num_scheduled_tokens) == (steps, gen, sched)
    assert info.num_requests_added == added and info.num_requests >= ids
    assert info.complete and info.status == "ok" and not info.damaged
    assert info.first_step == 0 and info.last_step == 39
    assert info.file_bytes == small_capture.stat().st_size and info.raw_bytes > info.file_bytes
    assert info.bytes_per_generated_token == round(info.file_bytes / gen, 2)


def test_info_by_linear_scan_agrees(small_capture, tmp_path):
    data = small_capture.read_bytes()
    index_at = struct.unpack_from("<Q", data, len(data) - 16)[0]
    p = tmp_path / "noindex.capture"
    p.write_bytes(data[:index_at])
    a, b = capture_info(small_capture), capture_info(p)
    assert not b.complete and not b.damaged
    for f in ("num_steps", "num_generated_tokens", "num_scheduled_tokens", "num_requests_added", "raw_bytes",
              "num_chunks"):
        assert getattr(a, f) == getattr(b, f), f


def test_info_counts_lost_steps(small_capture):
    with CaptureReader(small_capture) as r:
        c = r.index.chunks[4]
    data = bytearray(small_capture.read_bytes())
    data[c.offset + c.length - 6] ^= 1
    small_capture.write_bytes(bytes(data))
    info = capture_info(small_capture)
    assert info.damaged and info.damage[0].chunk == 4
    assert info.num_steps == 40 - c.num_steps
