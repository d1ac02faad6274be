"""Bisecting deep in a capture starts at the nearest keyframe, and gives the answer a bisect from step 0 gives for a
request the keyframe did not rebuild; a ring's snapshot, and a single segment of it, can be bisected at all (builtin
runner; vLLM's runner in tests/integrations/vllm/test_keyframes.py)."""

from __future__ import annotations

import pytest

from replay.bisect.batch import bisect_batch
from replay.bisect.layers import bisect_layers
from replay.capture import CaptureReader, Keyframe, Step, StepRange
from replay.capture.flight.control import request_snapshot
from replay.capture.reading.keyframe_seek import keyframe_steps
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic
from replay.replayer import ReplayOptions, replay_capture


def _deep_step(path) -> tuple[int, int, str]:
    """(keyframe, step past it, a request scheduled there with neighbours, not rebuilt by the keyframe)."""
    with CaptureReader(path) as r:
        keyframes = keyframe_steps(r)
        steps = {rec.index: rec for rec in r.records() if isinstance(rec, Step)}
        names = {}
        for rec in r.records():
            if hasattr(rec, "request") and hasattr(rec.request, "name"):
                names[rec.request.request_id] = rec.request.name
    for k in keyframes:
        for s in range(k + 1, k + 4):
            if s not in steps or s in keyframes:
                continue
            scheduled = list(steps[s].scheduler_output.num_scheduled_tokens)
            if len(scheduled) < 2:
                continue
            rebuilt = set(replay_capture(path, ReplayOptions(steps=StepRange(s, s))).rebuilt)
            fresh = [names.get(x, x) for x in scheduled if names.get(x, x) not in rebuilt]
            if fresh:
                return k, s, fresh[0]
    raise AssertionError("no step past a keyframe with a request it did not rebuild")


def test_bisect_batch_and_layers_past_a_keyframe_start_there_and_answer_as_from_step_0(keyed_capture):
    k, step, request = _deep_step(keyed_capture)
    near = bisect_batch(keyed_capture, step, request)
    whole = bisect_batch(keyed_capture, step, request, from_start=True)
    assert any(f"replayed from the keyframe at step {k}" in n for n in near.notes)
    assert not any("keyframe" in n for n in whole.notes)
    assert (near.start_step, whole.start_step) == (k, 0)
    assert (near.minimal_set, near.batch_invariant, near.max_abs_logit_diff, near.padding) == \
        (whole.minimal_set, whole.batch_invariant, whole.max_abs_logit_diff, whole.padding)
    assert near.token_alone == whole.token_alone and near.token_in_batch == whole.token_in_batch
    lnear = bisect_layers(keyed_capture, step, request, "solo")
    lwhole = bisect_layers(keyed_capture, step, request, "solo", from_start=True)
    assert [(m.module, m.equal, m.max_abs) for m in lnear.modules] == \
        [(m.module, m.equal, m.max_abs) for m in lwhole.modules]
    assert lnear.verdict == lwhole.verdict and any(f"keyframe at step {k}" in n for n in lnear.notes)


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=96, max_num_seqs=8,
                                                 max_num_batched_tokens=64), runner=RunnerConfig(num_threads=1))
    wl = synthetic(SyntheticWorkload(num_requests=300, arrival_rate=1.0, output_len=(8, 40),
                                     defaults={"logprobs": 3}), 512)
    path = tmp_path_factory.mktemp("ring") / "ring"
    record_builtin(RecordOptions(cfg, wl, path, ring=128 << 10, flush_interval=0.05))
    return path


@pytest.mark.parametrize("which", ["snapshot", "segment"])
def test_a_rings_snapshot_and_a_single_segment_can_be_bisected(ring, which):
    capture = request_snapshot(ring).path if which == "snapshot" else sorted(ring.glob("segment-*.capture"))[-2]
    k, step, request = _deep_step(capture)
    with CaptureReader(capture) as r:
        assert r.step_span()[0] == keyframe_steps(r)[0] > 0  # it opens past step 0, at a keyframe
    res = bisect_batch(capture, step, request)
    assert res.step == step and any("keyframe" in n for n in res.notes)
    layers = bisect_layers(capture, step, request, "solo")
    assert layers.modules and layers.step == step


@pytest.mark.parametrize("which", ["snapshot", "segment"])
def test_bisect_steps_and_config_and_check_run_on_a_rings_snapshot_and_segment(ring, which):
    from replay.bisect.config import bisect_config
    from replay.bisect.steps import bisect_steps
    from replay.replayer import check_capture

    capture = request_snapshot(ring).path if which == "snapshot" else sorted(ring.glob("segment-*.capture"))[-2]
    assert check_capture(capture).code == 0
    assert bisect_steps(capture).step is None  # it replays within tolerance from where it opens
    planted = bisect_steps(capture, opts=ReplayOptions(overrides={"dtype": "bfloat16"}))
    with CaptureReader(capture) as r:
        assert planted.step is not None and planted.step >= r.step_span()[0]
    res = bisect_config(capture, "", "dtype=bfloat16,threads=1")
    assert res.minimal_change == {"dtype": "bfloat16"}


def _two_fresh(path) -> tuple[int, str, str]:
    """(a step past the keyframe it replays from, two requests scheduled there that were first scheduled after it)."""
    with CaptureReader(path) as r:
        keyframes = keyframe_steps(r)
        first: dict[str, int] = {}
        names: dict[str, str] = {}
        steps = []
        for rec in r.records():
            arrivals = [x.request for x in getattr(rec, "requests", ())] + [getattr(rec, "request", None)]
            names.update((a.request_id, a.name) for a in arrivals if hasattr(a, "name"))  # (keyframes name some)
            if isinstance(rec, Step):
                steps.append(rec)
                for n in rec.scheduler_output.scheduled_new_reqs:
                    first.setdefault(n.req_id, rec.index)
    for s in steps:
        k = max((x for x in keyframes if x <= s.index), default=None)
        fresh = [x for x in s.scheduler_output.num_scheduled_tokens if k is not None and first.get(x, -1) >= k]
        if k is not None and s.index > k and len(fresh) >= 2:
            return s.index, names.get(fresh[0], fresh[0]), names.get(fresh[1], fresh[1])
    raise AssertionError("no step with two requests first scheduled after its keyframe")


@pytest.mark.parametrize("which", ["snapshot", "segment"])
def test_bisect_leak_and_explain_run_on_a_rings_snapshot_and_segment(ring, which):
    from replay.bisect.explain_divergence import CONFIG, NOTHING, explain_divergence
    from replay.bisect.leak import CONTAMINATION, NO_LEAK, bisect_leak
    from replay.replayer import Plant

    capture = request_snapshot(ring).path if which == "snapshot" else sorted(ring.glob("segment-*.capture"))[-2]
    step, request, neighbour = _two_fresh(capture)
    clean = bisect_leak(capture, step, request)
    assert clean.found == NO_LEAK and neighbour in clean.neighbours, clean.verdict
    assert any("keyframe" in n for n in clean.notes)
    planted = bisect_leak(capture, step, request, plant=Plant(step, request, "layers.0.mlp", 0.05, neighbour))
    assert planted.found == CONTAMINATION and planted.minimal_set == [neighbour], planted.verdict
    assert explain_divergence(capture).found == NOTHING
    assert explain_divergence(capture, ReplayOptions(overrides={"dtype": "bfloat16"})).found == CONFIG


@pytest.mark.parametrize("which", ["snapshot", "segment"])
def test_the_report_reads_a_rings_keyframes_as_arrivals_not_damage(ring, which, tmp_path):
    """A snapshot and a segment open with a keyframe: the report knows its live requests (their arrivals precede
    the capture) and finds nothing lost."""
    from replay.report import write_report
    from replay.report.run_facts import run_facts

    capture = request_snapshot(ring).path if which == "snapshot" else sorted(ring.glob("segment-*.capture"))[-2]
    with CaptureReader(capture) as r:
        first = r.step_span()[0]
        recs = list(r.records())
    [live, *_] = [x for x in recs if isinstance(x, Keyframe) and x.step == first]
    facts = run_facts(capture)
    assert facts.damage == []
    early = [x for x in live.requests if x.request.request_id in facts.requests]
    assert early and all(facts.requests[x.request.request_id].arrival == x.arrived < first for x in early)
    assert write_report(capture, tmp_path / "r.html").data_lost == []


def test_show_finds_a_request_live_at_the_opening_keyframe_by_its_own_id(ring):
    from replay.inspect.show import show_steps

    capture = sorted(ring.glob("segment-*.capture"))[-2]
    with CaptureReader(capture) as r:
        kf = next(x for x in r.records() if isinstance(x, Keyframe))
    live = next(x.request for x in kf.requests if x.scheduled)
    shown = show_steps(capture, request=live.name)
    assert shown.request == live.request_id and shown.external_ids[live.request_id] == live.name and shown.steps


def test_steps_before_a_segment_opens_are_refused_naming_the_steps_it_has(ring):
    from replay.errors import UsageError

    capture = sorted(ring.glob("segment-*.capture"))[-2]
    with CaptureReader(capture) as r:
        first, last = r.step_span()
    with pytest.raises(UsageError, match=f"the capture has steps {first}-{last}"):
        replay_capture(capture, ReplayOptions(steps=StepRange(0, first - 1)))


def test_a_snapshot_cut_short_still_opens_at_its_first_keyframe(ring, tmp_path):
    """Without its seek index a capture's opening step is read from its first records: --from-start starts there,
    and a replay from a later keyframe says so."""
    from pathlib import Path

    snap = Path(request_snapshot(ring).path)
    with CaptureReader(snap) as r:
        chunks = r.index.chunks
    second = [i for i, c in enumerate(chunks) if c.keyframe >= 0][1]
    # a cut two steps or more past the second keyframe: inside a chunk (a frame cut short is lost whole, the chunks
    # before it stay), or just past the last chunk (the index lost), where the snapshot ends soon after that keyframe
    cuts = [(c.offset + c.length // 2, chunks[j - 1].last_step) for j, c in enumerate(chunks) if j > second]
    cuts.append((chunks[-1].offset + chunks[-1].length + 3, chunks[-1].last_step))
    at = next((at for at, kept in cuts if kept >= chunks[second].keyframe + 2), None)
    assert at is not None, f"the snapshot ends within 2 steps of its second keyframe: {chunks[-1].last_step}"
    cut = tmp_path / "cut.capture"
    cut.write_bytes(snap.read_bytes()[:at])
    with CaptureReader(cut) as r:
        assert r.index is None
        last = max(x.index for x in r.records() if isinstance(x, Step))
        keyframes = keyframe_steps(r)  # (read from the records: the cut took the index)
    opening, later = keyframes[0], keyframes[1]
    assert later + 2 <= last
    rep = replay_capture(cut, ReplayOptions(steps=StepRange(opening + 1, opening + 2), from_start=True))
    assert rep.keyframe == opening and rep.data_lost
    rep = replay_capture(cut, ReplayOptions(steps=StepRange(later + 1, later + 2)))
    assert rep.keyframe == later and f"--from-start replays from step {opening}" in rep.keyframe_why


def test_a_bisect_that_leaves_neighbours_out_starts_before_they_were_scheduled_never_at_a_keyframe_that_keeps_them(
        keyed_capture):
    """`keyed_capture`: r6's neighbours at step 29, r5 and r7, are live at the keyframes of steps 28 down to 12 (r5)
    and 24 (r7): from there no run can leave them out of the steps before, nor swap them. A bisect that does (`bisect
    leak`; `bisect batch` and `solo` on vLLM's runner, modelled here by a builtin session whose neighbours are its
    companions) starts at step 8, before both were scheduled, and says so; one that keeps every neighbour anyway is
    refused (exit 125), never called batch-invariant; with no clear keyframe it starts at step 0."""
    from replay.bisect.batch import _bisect
    from replay.bisect.builtin_session import StepSession
    from replay.bisect.leak import NO_LEAK, bisect_leak
    from replay.bisect.open_session import make_session
    from replay.diff import Tolerance
    from replay.errors import CannotTestError
    from replay.replayer.start import live_at

    with CaptureReader(keyed_capture) as r:
        assert {"r5-000005", "r7-000007"} <= live_at(r, 28) and not {"r5-000005", "r7-000007"} & live_at(r, 8)
    leak, whole = bisect_leak(keyed_capture, 29, "r6"), bisect_leak(keyed_capture, 29, "r6", from_start=True)
    assert leak.found == whole.found == NO_LEAK and {"r5", "r7"} <= set(leak.neighbours), leak.verdict
    assert any(n.startswith("replayed from the keyframe at step 8 (the nearest keyframe before request r6's 2 "
                            "neighbours at step 29 were scheduled: at the one of step 28, all 2 were live")
               for n in leak.notes), leak.notes

    class EveryStep(StepSession):  # leaves neighbours out of every step up to S, as vLLM's runner's session does
        def neighbours(self, rid):
            return self.companions(rid)

        def run(self, watch, keep=None, pad=0, hooks=None, **kw):
            return super().run(watch, keep, pad, hooks, throughout=True, **kw)

    s = EveryStep(keyed_capture, 29, watch="r6")
    assert s.start.keyframe == 8 and {"r5-000005", "r7-000007"} <= set(s.companions("r6-000006"))
    kept = EveryStep(keyed_capture, 29)  # the nearest keyframe, where both are live
    with pytest.raises(CannotTestError, match="r5, r7 are live at the keyframe of step 28.*--from-start"):
        _bisect(kept, str(keyed_capture), "r6", Tolerance(), None, lambda msg: None, None)
    early = make_session(keyed_capture, 11, watch="r1")  # its neighbours r0, r2, r3: live at step 8's, and r0 at 4's
    assert early.start.keyframe is None
    assert any(n.startswith("replayed from step 0: at every keyframe up to step 8 some of request r1's")
               for n in early.notes), early.notes
