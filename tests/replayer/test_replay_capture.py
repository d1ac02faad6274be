"""Replay: self-replay is bitwise; other numerics diverge and are classified; planted faults are found exactly."""

from __future__ import annotations

import random

import pytest
from typer.testing import CliRunner

from replay.capture import StepRange
from replay.cli import app
from replay.contracts import SamplingParams
from replay.diff import Tolerance
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.record import RecordOptions, WorkloadRequest, record_builtin
from replay.replayer import Plant, ReplayOptions, check_capture, replay_capture

cli = CliRunner()


def _req(i: int, prompt: list[int], **sp) -> WorkloadRequest:
    return WorkloadRequest(SamplingParams(**{"max_tokens": 10, "logprobs": 3, **sp}), None, prompt, f"r{i}", i // 3)


@pytest.fixture(scope="module")
def rich_capture(tmp_path_factory):
    """A capture with every feature replay must reproduce: greedy, seeded and unseeded sampling, top-k / top-p /
    min-p, penalties, stop tokens, chunked prefill, prefix-cache hits, preemption + resume, prompt logprobs."""
    shared = list(range(20, 44))
    reqs = [
        _req(0, shared + [5, 6, 7], temperature=0.0),
        _req(1, shared + [8, 9], temperature=0.9, seed=42, top_k=30),
        _req(2, list(range(100, 130)), temperature=0.8, top_p=0.9),  # unseeded: the engine draws its seed
        _req(3, shared + [60, 61, 62, 63], temperature=0.7, min_p=0.05, seed=3),
        _req(4, list(range(200, 220)), temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
             presence_penalty=0.2),
        _req(5, list(range(300, 340)), temperature=0.0, prompt_logprobs=2),
        _req(6, shared, temperature=1.0, stop_token_ids=[7, 8, 9, 10, 11, 12, 13, 14, 15], max_tokens=30),
        _req(7, list(range(400, 436)), temperature=0.6, seed=11, min_tokens=4),
    ]
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=30, max_num_seqs=6,
                                                 max_num_batched_tokens=20),
                       runner=RunnerConfig(num_threads=1, seed=5))
    path = tmp_path_factory.mktemp("rich") / "rich.capture"
    record_builtin(RecordOptions(cfg, reqs, path))
    return path


def test_the_rich_capture_really_has_every_feature(rich_capture):
    from replay.capture import CaptureReader, Step

    preempted = hits = partial = drawn = plp = 0
    with CaptureReader(rich_capture) as r:
        for s in r.records():
            if isinstance(s, Step):
                so, m = s.scheduler_output, s.model_runner_output
                preempted += len(so.scheduled_cached_reqs.resumed_req_ids)
                hits += sum(n.num_computed_tokens > 0 for n in so.scheduled_new_reqs)
                partial += sum(t == [] for t in m.sampled_token_ids)
                drawn += len(s.drawn_seeds)
                plp += sum(v is not None for v in m.prompt_logprobs_dict.values())
    assert preempted and hits and partial and drawn and plp


@pytest.mark.parametrize("mode", ["forced", "free"])
def test_self_replay_is_bitwise(rich_capture, mode):
    rep = replay_capture(rich_capture, ReplayOptions(mode=mode))
    assert not rep.diverged, rep.first_divergence
    assert rep.verdict.startswith("MATCH: every replayed step equals the recording")  # as the terminal says it
    assert rep.steps_replayed == len(rep.steps) > 20 and rep.environment_differences == []
    assert repr(rep) == f"ReplayReport({str(rich_capture)!r}: {rep.verdict}; {rep.steps_replayed} steps replayed)"


def test_another_dtype_diverges_and_flips_are_classified(rich_capture):
    rep = replay_capture(rich_capture, ReplayOptions(overrides={"dtype": "bfloat16"}))
    assert rep.diverged and rep.environment_differences == ["dtype: recorded float32, replay bfloat16"]
    first = rep.first_divergence
    assert first.step == 0 and first.max_abs_logprob_diff > 0
    assert rep.batch is not None and first.request_id in rep.batch.request_ids
    assert "--set dtype=bfloat16" in rep.repro
    for d in rep.divergences:
        if d.kind == "token":
            assert d.flip in ("tie", "confident") and d.margin is not None
            assert (d.flip == "tie") == (d.margin < 0.05 or d.margin <= 2 * d.max_abs_logprob_diff)


def test_tolerance_absorbs_small_differences(rich_capture):
    loose = replay_capture(rich_capture, ReplayOptions(overrides={"attention": "reference"},
                                                       tolerance=Tolerance(atol=1e-4, rtol=0)))
    assert not loose.diverged


def test_planted_divergences_are_found_exactly_where_planted(rich_capture):
    from replay.capture import CaptureReader, RequestAdded, Step

    ext, steps = {}, []
    with CaptureReader(rich_capture) as r:
        for rec in r.records():
            if isinstance(rec, RequestAdded):
                ext[rec.request.request_id] = rec.request.external_req_id
            elif isinstance(rec, Step) and rec.scheduler_output.total_num_scheduled_tokens:
                steps.append((rec.index, [ext[x] for x in rec.scheduler_output.num_scheduled_tokens]))
    modules = ["embed_tokens", "layers.0.self_attn.q_proj", "layers.1.self_attn.attn", "layers.2.mlp.down_proj",
               "layers.3.input_layernorm", "layers.1.post_attention_layernorm", "norm", "lm_head"]
    rnd = random.Random(2024)
    print("plant seed 2024")
    for _ in range(20):
        step, reqs = rnd.choice(steps[:-1])
        plant = Plant(step, rnd.choice(reqs), rnd.choice(modules), rnd.choice([1e-3, 1e-2, 0.1, 1.0]))
        rep = replay_capture(rich_capture, ReplayOptions(plant=plant, steps=StepRange(0, step + 3)))
        assert rep.diverged, plant
        places = {(d.step, d.request_id) for d in rep.divergences}
        assert places == {(plant.step, plant.request)}, (plant, places)


def test_repeat_reports_run_to_run_determinism(rich_capture):
    rep = replay_capture(rich_capture, ReplayOptions(repeat=2, steps=StepRange(0, 8)))
    assert rep.run_to_run.startswith("deterministic")


def test_repeats_fanned_out_to_other_processes_give_the_serial_answer(rich_capture):
    from replay.processes.fanout import FanOut

    serial = replay_capture(rich_capture, ReplayOptions(repeat=3, steps=StepRange(0, 8)))
    fanned = replay_capture(rich_capture, ReplayOptions(repeat=3, steps=StepRange(0, 8), fan_out=FanOut(jobs=2)))
    assert fanned.run_to_run == serial.run_to_run == "deterministic: 3 replays bitwise identical"


def test_check_exit_codes(rich_capture, tmp_path, small_capture):
    assert check_capture(rich_capture).code == 0
    assert check_capture(rich_capture, ReplayOptions(overrides={"dtype": "bfloat16"})).code == 1
    assert check_capture(small_capture).code == 125  # a synthetic capture has no model to replay on
    missing = check_capture(tmp_path / "missing.capture")
    assert missing.code == 125 and "missing.capture" in missing.reason and "no such file" in missing.reason
    assert check_capture(rich_capture, ReplayOptions(overrides={"model": str(tmp_path)})).code == 125  # model missing


def test_steps_outside_the_capture_are_a_usage_error_not_a_match(rich_capture):
    res = cli.invoke(app, ["run", str(rich_capture), "--diff", "--steps", "400-500"])
    assert res.exit_code == 2 and "nothing to compare" in res.stderr and "MATCH" not in res.stdout


def test_steps_where_no_request_sampled_are_no_match(rich_capture, tmp_path):
    from replay.capture import CaptureReader, Step

    with CaptureReader(rich_capture) as r:
        empty = [s.index for s in r.records()
                 if isinstance(s, Step) and not (s.model_runner_output and s.model_runner_output.req_ids)]
    assert empty  # (the engine's last step only tells the runner which requests finished)
    res = cli.invoke(app, ["run", str(rich_capture), "--diff", "--steps", str(empty[-1])])
    assert res.exit_code == 2 and "nothing to compare in its 1 step" in res.stderr and "MATCH" not in res.stdout
    assert check_capture(rich_capture, ReplayOptions(steps=StepRange(empty[-1], empty[-1]))).code == 125
    # a 40-token prompt under a budget of 16: steps 0 and 1 each compute a chunk of it and sample nothing; with
    # logprobs, the rows of the tokens they discard are compared
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=30, max_num_batched_tokens=16),
                       runner=RunnerConfig(num_threads=1))
    for logprobs in (None, 3):
        chunky = record_builtin(RecordOptions(cfg, [_req(0, list(range(100, 140)), temperature=0.0,
                                                         logprobs=logprobs)], tmp_path / f"{logprobs}.capture")).path
        res = cli.invoke(app, ["run", str(chunky), "--diff", "--steps", "0-1"])
        if logprobs is None:
            assert res.exit_code == 2 and "nothing to compare in its 2 steps" in res.stderr, res.output
        else:
            assert res.exit_code == 0 and "0 sampled tokens (2 logprob rows: prefills in chunks" in res.stdout
        assert cli.invoke(app, ["run", str(chunky), "--diff", "--steps", "0-2"]).exit_code == 0


def test_every_report_says_what_it_compared(rich_capture):
    rep = replay_capture(rich_capture, ReplayOptions(steps=StepRange(2, 5)))
    assert rep.steps_compared == 4 and rep.steps_replayed == 6
    assert 0 < rep.requests_compared <= 8 and rep.tokens_compared >= rep.requests_compared
    res = cli.invoke(app, ["run", str(rich_capture), "--diff", "--steps", "2-5"])
    assert f"compared 4 steps, {rep.requests_compared} requests, {rep.tokens_compared} sampled tokens" in res.stdout


def test_cli_run_and_check(rich_capture, tmp_path):
    res = cli.invoke(app, ["run", str(rich_capture), "--diff"])
    assert res.exit_code == 0 and "MATCH" in res.stdout
    res = cli.invoke(app, ["run", str(rich_capture), "--diff", "--set", "dtype=bfloat16"])
    assert res.exit_code == 1 and "DIVERGED" in res.stdout and "re-run: replay run" in res.stdout
    res = cli.invoke(app, ["run", str(rich_capture), "--diff", "--set", "dtype=bfloat16", "--json"])
    import json

    data = json.loads(res.stdout)
    assert data["diverged"] is True and data["verdict"].startswith("DIVERGED: ")
    assert "first at step 0" in data["verdict"]
    assert set(data["first_divergence"]) >= {"step", "request_id", "position", "expected_token", "actual_token",
                                             "max_abs_logprob_diff", "margin", "flip"}
    assert cli.invoke(app, ["check", str(rich_capture)]).exit_code == 0
    assert cli.invoke(app, ["check", str(tmp_path / "nope.capture")]).exit_code == 125


@pytest.mark.parametrize("args, message", [
    (["--set", "colour=blue"], "unknown knob"),
    (["--set", "dtype"], "expected KNOB=VALUE"),
    (["--set", "dtype=float8"], "dtype"),
    (["--mode", "sideways"], "forced or free"),
    (["--plant", "3:r1"], "STEP:REQUEST:MODULE:SIZE"),
    (["--plant", "3:r1:no.such.module:1"], "no module"),
    (["--steps", "9-2"], "ends before it starts"),
])
def test_cli_bad_replay_arguments(rich_capture, args, message):
    res = cli.invoke(app, ["run", str(rich_capture), "--diff", *args])
    assert res.exit_code == 2 and message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_different_model_is_refused_unless_forced(rich_capture, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, vocab_size=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "other")
    res = cli.invoke(app, ["run", str(rich_capture), "--diff", "--set", f"model={tmp_path / 'other'}", "--steps",
                           "0-2"])
    assert res.exit_code == 2 and "--force" in res.stderr
    res = cli.invoke(app, ["run", str(rich_capture), "--diff", "--set", f"model={tmp_path / 'other'}", "--steps", "0-2",
                           "--force"])
    assert res.exit_code == 1 and "model weights differ" in res.stdout


def test_a_capture_recovered_from_a_loss_still_says_data_was_lost(tmp_path):
    """`recover` rewrites a capture whose middle chunk was lost into an intact file with a gap in its steps: a
    replay stops at the gap and a diff cuts the requests live there, and both say data was lost (exit 3)."""
    from replay.capture import CaptureReader
    from replay.capture.reading.recover import recover
    from replay.diff import diff_captures
    from replay.record import SyntheticWorkload, synthetic
    from tests.capture.reading.test_read_ahead import corrupt_chunk

    path = tmp_path / "a.capture"
    wl = synthetic(SyntheticWorkload(num_requests=12, arrival_rate=1.0, output_len=(8, 20)), 512)
    record_builtin(RecordOptions(EngineConfig(runner=RunnerConfig(num_threads=1)), wl, path, flush_interval=0.0005))
    with CaptureReader(path) as r:
        middle = next(i for i, c in enumerate(r.index.chunks) if c.num_steps and c.first_step > 2)
    corrupt_chunk(path, middle)
    fixed = recover(path).output
    rep = replay_capture(fixed)
    assert rep.stopped and rep.data_lost and rep.data_lost[0].startswith("recovered from a.capture")
    res = diff_captures(fixed, path)
    assert not res.diverged and res.data_lost and res.requests_compared > 0
    out = CliRunner().invoke(app, ["run", fixed, "--diff"])
    assert out.exit_code == 3 and "data was lost" in out.stdout, out.output


def test_the_repeat_digest_leaves_out_only_what_no_replay_from_a_keyframe_repeats():
    """An unseeded request's draw (its token, and column 0 of its row) and a request whose drafts were verified with
    such draws (its tokens and rows: how many it accepted differs) are left out; anything else counts."""
    import numpy as np

    from replay.contracts import Array, LogprobsLists, ModelRunnerOutput
    from replay.replayer.replay_capture import _digest

    def out(tokens: dict[str, list[int]], top: float = -2.0):
        ids, vals, cu = [], [], [0]
        for toks in tokens.values():
            for t in toks:
                ids.append([t, 7])
                vals.append([-1.0 - t / 100, top])
            cu.append(cu[-1] + len(toks))
        lp = LogprobsLists(Array.from_numpy(np.array(ids, np.int32)), Array.from_numpy(np.array(vals, np.float32)),
                           Array.from_numpy(np.ones(len(ids), np.int64)), cu)
        return ModelRunnerOutput(list(tokens), {r: i for i, r in enumerate(tokens)}, list(tokens.values()), lp)

    a = _digest(out({"u": [5], "g": [1, 2, 3], "x": [9]}), {"u"}, {"g"})
    assert a == _digest(out({"u": [6], "g": [1], "x": [9]}), {"u"}, {"g"})  # another draw, another acceptance
    assert a != _digest(out({"u": [5], "g": [1, 2, 3], "x": [8]}), {"u"}, {"g"})  # the others still count
    assert _digest(out({"u": [5]}), {"u"}) != _digest(out({"u": [5]}, top=-3.0), {"u"})  # and its top-k
