"""Where a replay that has to reach step S starts: at the nearest keyframe at or before S by itself, from step 0 with
--from-start, and a ring's snapshot where it opens. The in-window requests' verdict is the one a replay from step 0
gives."""

from __future__ import annotations

from typer.testing import CliRunner

from replay.capture import CaptureReader, StepRange
from replay.capture.reading.keyframe_seek import keyframe_steps
from replay.cli import app
from replay.errors import UsageError
from replay.replayer import ReplayOptions, replay_capture
from replay.replayer.start import start_at

cli = CliRunner()


def _keyframes(path) -> list[int]:
    with CaptureReader(path) as r:
        return keyframe_steps(r)


def test_steps_past_a_keyframe_start_there_by_themselves_with_the_verdict_of_a_replay_from_step_0(keyed_capture):
    k = _keyframes(keyed_capture)[4]
    window = StepRange(k + 2, k + 10)
    near = replay_capture(keyed_capture, ReplayOptions(steps=window))
    whole = replay_capture(keyed_capture, ReplayOptions(steps=window, from_start=True))
    assert near.keyframe == k and f"nearest keyframe at or before step {k + 2}" in near.keyframe_why
    assert whole.keyframe is None and whole.steps_replayed > near.steps_replayed
    assert near.requests_compared == whole.requests_compared and near.tokens_compared == whole.tokens_compared
    # bitwise: the requests that arrived inside the window ran in the recorded batches, as from step 0; those live at
    # the keyframe are named, and held to the rebuild tolerance
    assert not near.diverged and not whole.diverged and near.rebuilt and near.tolerance.bitwise


def test_a_capture_without_a_keyframe_before_the_steps_starts_at_step_0(keyed_capture, small_capture):
    with CaptureReader(small_capture) as r:
        assert start_at(r, 30).keyframe is None
    with CaptureReader(keyed_capture) as r:
        first = keyframe_steps(r)[0]
        assert start_at(r, first - 1).keyframe is None
        assert start_at(r, first).keyframe == first and start_at(r, first, from_start=True).keyframe is None


def test_the_command_line_says_where_it_started_and_why(keyed_capture):
    k = _keyframes(keyed_capture)[2]
    res = cli.invoke(app, ["run", str(keyed_capture), "--diff", "--steps", f"{k + 1}-{k + 5}"])
    assert res.exit_code == 0, res.output
    assert f"from the keyframe at step {k}" in res.output
    assert f"nearest keyframe at or before step {k + 1}" in res.output
    res = cli.invoke(app, ["run", str(keyed_capture), "--diff", "--steps", f"{k + 1}-{k + 5}", "--from-start"])
    assert res.exit_code == 0 and "from the keyframe" not in res.output
    res = cli.invoke(app, ["check", str(keyed_capture), "--steps", f"{k + 1}-{k + 5}"])
    assert res.exit_code == 0, res.output
    res = cli.invoke(app, ["run", str(keyed_capture), "--steps", "1-2", "--from-keyframe", "--from-start"])
    assert res.exit_code == 2 and "pick one" in res.stderr


def test_a_capture_that_opens_past_step_0_without_a_keyframe_is_refused(keyed_capture, tmp_path):
    from replay.capture import CaptureWriter, Keyframe, Step

    cut = tmp_path / "cut.capture"
    with CaptureReader(keyed_capture) as r, CaptureWriter(cut, r.header) as w:
        for rec in r.records():
            if not isinstance(rec, Keyframe) and not (isinstance(rec, Step) and rec.index < 3):
                w.write_record(rec)
    with CaptureReader(cut) as r:
        try:
            start_at(r, None)
        except UsageError as e:
            assert "starts at step 3 without a keyframe there" in str(e)
        else:
            raise AssertionError("a capture opening at step 3 with no keyframe there was not refused")


def test_the_command_that_reproduces_a_divergence_starts_where_the_replay_did(keyed_capture):
    """A divergence found by a replay from step 0 is re-run from step 0: a nearer keyframe would rebuild the request,
    and compare it within the rebuild tolerance."""
    from replay.replayer import Plant

    k = _keyframes(keyed_capture)[3]
    with CaptureReader(keyed_capture) as r:
        step = next(rec for rec in r.records() if getattr(rec, "index", -1) == k + 2)
    request = sorted(step.scheduler_output.num_scheduled_tokens)[0]
    plant = Plant.parse(f"{k + 2}:{request}:layers.1.mlp:1e-4")
    rep = replay_capture(keyed_capture, ReplayOptions(plant=plant))
    assert rep.diverged and rep.first_divergence.step == k + 2 and "--from-start" in rep.repro, rep.repro
    again = cli.invoke(app, rep.repro.split()[1:])
    assert again.exit_code == 1 and f"first at step {k + 2}" in again.stdout, again.output


def test_prompt_logprobs_are_compared_over_the_rows_computed_after_the_keyframe(tmp_path):
    """A keyframe in the middle of a prompt whose logprobs were asked for: the rows before it were computed before
    the replay began, so the rows after it are compared; a request past its prompt at the keyframe has none to give."""
    from replay.contracts import SamplingParams
    from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
    from replay.record import RecordOptions, WorkloadRequest, record_builtin

    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, prompt_logprobs=3)
    reqs = [WorkloadRequest(sp, None, list(range(40, 52)), "short", 0),
            WorkloadRequest(sp, None, [(7 * j) % 500 + 3 for j in range(50)], "long", 2)]
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=64, max_num_seqs=4,
                                                 max_num_batched_tokens=16), runner=RunnerConfig(num_threads=1))
    path = record_builtin(RecordOptions(cfg, reqs, tmp_path / "plp.capture", keyframe_steps=1)).path
    mid_prompt = past_prompt = 0
    with CaptureReader(path) as r:
        keyframes = [x for x in r.records() if type(x).__name__ == "Keyframe"]
        last = r.step_span()[1]  # (the last step only finishes requests)
    for kf in keyframes[:-1] if keyframes[-1].step == last else keyframes:
        live = {x.request.name: x for x in kf.requests if x.scheduled and x.num_computed_tokens}
        if not live:
            continue
        mid_prompt += any(not x.output_token_ids for x in live.values())
        past_prompt += any(x.output_token_ids for x in live.values())
        rep = replay_capture(path, ReplayOptions(steps=StepRange(kf.step, kf.step + 4)))
        assert rep.keyframe == kf.step and not rep.diverged, (kf.step, rep.first_divergence)
    assert mid_prompt and past_prompt
