"""`run_facts` reads a capture without decoding logprobs and counts column-wise; its numbers must be exactly those
of `replay.inspect.step_summary` (what `replay export --format perfetto` shows), step by step and request by
request, on a builtin recording with preemptions, prefix hits and chunked prefills, and on a synthetic one."""

from __future__ import annotations

import pytest

from replay.capture import CaptureReader, RequestAborted, RequestAdded, Step
from replay.inspect.step_summary import StepSummarizer, infer_preemptions
from replay.report.run_facts import run_facts


def _expected(path):
    """Per-step and per-request numbers the slow way: every record decoded, StepSummarizer, infer_preemptions."""
    summ, steps, added, aborted = StepSummarizer(), [], [], set()
    with CaptureReader(path) as r:
        for rec in r.records():
            if isinstance(rec, Step):
                steps.append(summ.summarise(rec))
            elif isinstance(rec, RequestAdded):
                summ.add_request(rec.request)
                added.append(rec.request.request_id)
            elif isinstance(rec, RequestAborted):
                aborted.add(rec.request_id)
    infer_preemptions(steps)
    per_step = {
        "requests": [len(s.scheduled) for s in steps], "prefill": [sum(s.prefill.values()) for s in steps],
        "decode": [sum(s.scheduled.values()) - sum(s.prefill.values()) for s in steps],
        "preempted": [len(s.preempted) for s in steps], "prefix_hits": [len(s.cached_prefix) for s in steps],
        "new": [s.new for s in steps], "finished": [len(s.finished) for s in steps],
    }
    ran: dict[str, list[int]] = {}
    for pos, s in enumerate(steps):
        for rid in s.scheduled:
            ran.setdefault(rid, []).append(pos)
    tokens = {rid: sum(s.generated.get(rid, 0) for s in steps) for rid in ran}
    preempted = {rid: sum(rid in s.preempted for s in steps) for rid in ran}
    finished = {rid for s in steps for rid in s.finished}
    return per_step, ran, tokens, preempted, finished, aborted, added


@pytest.fixture
def format_1_3():
    """A format 1.3 capture (steps as `PackedStep`): the report's step heads read the older form too."""
    from tests.capture.reading.test_reader import FORMAT_1_3

    return FORMAT_1_3


@pytest.mark.parametrize("which", ["recorded", "big_synthetic", "format_1_3"])
def test_run_facts_count_what_step_summary_counts(which, request):
    path = request.getfixturevalue(which)
    per_step, ran, tokens, preempted, finished, aborted, added = _expected(path)
    facts = run_facts(path)
    for name, values in per_step.items():
        assert facts.series[name].tolist() == values, name
    assert set(facts.requests) == set(ran) | set(added)
    for rid, positions in ran.items():
        f = facts.requests[rid]
        assert [p for a, b in f.spans for p in range(a, b + 1)] == positions, rid
        assert (f.first, f.last, f.tokens, f.preemptions) == (positions[0], positions[-1], tokens[rid],
                                                             preempted[rid]), rid
        assert f.status == ("aborted" if rid in aborted else "finished" if rid in finished else f.status)
    assert list(facts.requests)[:len(added)] == added  # arrival order


def test_the_recording_exercises_preemption_prefix_hits_and_chunked_prefill(recorded):
    facts = run_facts(recorded)
    s = facts.series
    assert s["preempted"].sum() > 0 and s["prefix_hits"].sum() > 0
    assert ((s["prefill"] > 0) & (s["decode"] > 0)).any(), "a step mixing prefill chunks and decodes"
    assert facts.timed == len(facts.index) and s["execute_ns"].min() > 0
    assert all(f.status in ("finished", "finished (inferred)") for f in facts.requests.values())


def test_a_damaged_capture_reports_what_it_lost_and_keeps_the_rest(small_capture, tmp_path):
    data = bytearray(small_capture.read_bytes())
    with CaptureReader(small_capture) as r:
        chunk = [c for c in r.iter_chunks() if c.info.num_steps][-2]  # a chunk of steps, not the last
    data[chunk.offset + chunk.info.length // 2] ^= 0xFF
    bad = tmp_path / "bad.capture"
    bad.write_bytes(bytes(data))
    facts = run_facts(bad)
    whole = run_facts(small_capture)
    assert facts.damage and 0 < len(facts.index) < len(whole.index)
    assert facts.damage[0].chunk == chunk.number
