"""StepLoop: the one replay loop. Steps are taken in order from step 0 with none missing; a loop told to stop
before a step leaves the runner exactly where the recording was before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.capture import CaptureReader, Step
from replay.errors import UsageError
from replay.replayer import StepLoop, build_runner

GOLDEN = Path(__file__).resolve().parents[2] / "captures" / "tiny-mixed.capture"


def _records():
    with CaptureReader(GOLDEN) as r:
        return r.header, list(r.records())


def test_a_missing_step_ends_the_replay_there_and_says_why():
    header, records = _records()
    gap = [r for r in records if not (isinstance(r, Step) and r.index == 5)]
    loop = StepLoop(GOLDEN, build_runner(header, {}).runner)
    assert [s.index for s in loop.steps(gap)] == [0, 1, 2, 3, 4]
    assert loop.stopped == "steps 5-5 are missing: the replay stops after step 4"


def test_a_capture_that_starts_late_is_refused():
    header, records = _records()
    late = [r for r in records if not (isinstance(r, Step) and r.index < 3)]
    with pytest.raises(UsageError, match="starts at step 3"):
        list(StepLoop(GOLDEN, build_runner(header, {}).runner).steps(late))


def test_stopping_before_a_step_keeps_it_and_the_tokens_it_reads():
    header, records = _records()
    loop = StepLoop(GOLDEN, build_runner(header, {}).runner)
    ran = [step.index for step, _ in loop.replay(records, until=7)]
    assert ran == list(range(7)) and loop.next_step.index == 7 and loop.steps_run == 7
    before = next(r for r in records if isinstance(r, Step) and r.index == 6).model_runner_output
    assert loop.sampled == {rid: t for rid, t in zip(before.req_ids, before.sampled_token_ids) if t}
    assert set(loop.external.values()) >= {f"req-{i}" for i in range(3)}


def test_forced_and_free_replays_of_an_exact_runner_agree():
    header, records = _records()
    outs = {}
    for mode in ("forced", "free"):
        loop = StepLoop(GOLDEN, build_runner(header, {}).runner, mode)
        outs[mode] = [actual.sampled_token_ids for _, actual in loop.replay(records)]
    assert outs["forced"] == outs["free"] and len(outs["free"]) > 20


def test_an_unknown_mode_is_a_usage_error():
    header, _ = _records()
    with pytest.raises(UsageError, match="--mode 'eager'"):
        StepLoop(GOLDEN, build_runner(header, {}).runner, "eager")
