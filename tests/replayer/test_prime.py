"""Replay from a keyframe on the builtin runner: the runner primed from the keyframe (K/V rebuilt by pseudo-request
prefills, live requests restored with their generators), then the recorded steps.

Requests that arrive inside the window must replay bitwise; requests live at the keyframe (and those that hit a
rebuilt block in the prefix cache) read K/V computed by a prefill where the recording decoded, and are compared
within the rebuild tolerance and named as rebuilt. The capture has everything a keyframe must carry: greedy, seeded
and unseeded sampling (the generators must resume mid-stream), penalties (prompt and output tokens kept apart),
chunked prefill, prefix-cache hits, preemption and resume.
"""

from __future__ import annotations

from typer.testing import CliRunner

from replay.capture import CaptureReader, Keyframe, StepRange
from replay.capture.reading.keyframe_seek import keyframe_steps
from replay.cli import app
from replay.contracts import SamplingParams
from replay.diff import Tolerance
from replay.errors import UsageError
from replay.replayer import ReplayOptions, replay_capture
from replay.replayer.prime import REBUILD_ATOL, plan_priming

cli = CliRunner()


def _keyframes(path) -> list[Keyframe]:
    with CaptureReader(path) as r:
        return [rec for rec in r.records() if isinstance(rec, Keyframe)]


def test_the_keyframes_see_preemption_prefix_hits_and_mid_stream_generators(keyed_capture):
    kfs = _keyframes(keyed_capture)
    assert [k.step for k in kfs] == keyframe_steps(CaptureReader(keyed_capture)) and len(kfs) >= 8
    assert any(r.preempted for k in kfs for r in k.requests)
    assert any(k.cached for k in kfs)  # blocks finished requests left for the prefix cache
    assert any(r.num_draws and r.request.sampling_params.seed is None and r.drawn_seed is not None
               for k in kfs for r in k.requests)


def test_every_keyframe_replays_in_window_requests_bitwise_and_rebuilt_ones_within_the_rebuild_tolerance(
        keyed_capture):
    worst = 0.0
    for kf in _keyframes(keyed_capture):
        rng = StepRange(kf.step, kf.step + 12)
        try:
            bitwise = replay_capture(keyed_capture, ReplayOptions(steps=rng, from_keyframe=True))
        except UsageError as e:  # (the last step only tells the runner what finished: no verdict on nothing)
            assert "nothing to compare" in str(e), kf.step
            continue
        assert bitwise.keyframe == kf.step and bitwise.steps_replayed <= 13, kf.step
        assert not bitwise.diverged, (kf.step, bitwise.first_divergence)
        # the same replay with the rebuilt requests held to the bits too: only they may differ, and by little
        import replay.replayer.prime as prime

        saved = dict(prime.REBUILD_ATOL)
        prime.REBUILD_ATOL.update({k: 0.0 for k in saved})
        try:
            exact = replay_capture(keyed_capture, ReplayOptions(steps=rng, from_keyframe=True,
                                                                tolerance=Tolerance()))
        finally:
            prime.REBUILD_ATOL.update(saved)
        for d in exact.divergences:
            assert d.request_id in exact.rebuilt, (kf.step, d)
            assert d.kind == "logprobs", (kf.step, d)  # no token moved: generators resumed where they were
            worst = max(worst, d.max_abs_logprob_diff)
    assert 0 < worst < REBUILD_ATOL["float32"] / 5


def test_a_replay_from_a_keyframe_sees_a_changed_dtype(keyed_capture):
    k = _keyframes(keyed_capture)[3].step
    rep = replay_capture(keyed_capture, ReplayOptions(steps=StepRange(k, k + 20), from_keyframe=True,
                                                      overrides={"dtype": "bfloat16"}))
    assert rep.diverged and rep.keyframe == k and "dtype" in rep.suspect


def test_priming_writes_each_block_after_every_earlier_writer_of_it():
    from replay.capture import CachedBlocks, LiveRequest
    from replay.contracts import EngineCoreRequest

    req = EngineCoreRequest("a", list(range(8)), None, SamplingParams(), None, 0.0, None, None, None)
    kf = Keyframe(5, [LiveRequest(req, 0, True, [9], 8, [[3, 7]])],
                  [CachedBlocks(list(range(100, 108)), [[3, 4]], 1), CachedBlocks(list(range(200, 204)), [[5]], 2)],
                  block_size=4)
    p = plan_priming(kf, budget=6)
    first_step = {so_id: i for i, so in enumerate(p.steps) for so_id in so.num_scheduled_tokens}
    assert first_step["replay-prime:a"] > max(i for i, so in enumerate(p.steps)
                                              if "replay-prime:0" in so.num_scheduled_tokens)
    assert sum(so.total_num_scheduled_tokens for so in p.steps) == p.tokens == 8 + 4 + 8
    assert all(so.total_num_scheduled_tokens <= 6 for so in p.steps)
    assert p.steps[-1].finished_req_ids and not p.steps[-1].num_scheduled_tokens
    assert p.rebuilt == {"a"} and p.blocks == {3, 4, 5, 7}


def test_the_cli_starts_at_the_keyframe_and_says_what_it_rebuilt(keyed_capture):
    k = _keyframes(keyed_capture)[2].step
    res = cli.invoke(app, ["run", str(keyed_capture), "--diff", "--steps", f"{k + 1}-{k + 9}", "--from-keyframe"])
    assert res.exit_code == 0, res.output
    assert f"from the keyframe at step {k}" in res.output and "rebuilt from the keyframe" in res.output
    assert "MATCH" in res.output
    res = cli.invoke(app, ["run", str(keyed_capture), "--diff", "--from-keyframe"])
    assert res.exit_code == 2 and "--from-keyframe needs --steps" in res.output
    res = cli.invoke(app, ["info", str(keyed_capture)])
    assert f"keyframes {len(_keyframes(keyed_capture))}, before steps" in res.output
