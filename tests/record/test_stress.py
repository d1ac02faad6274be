"""stress and the batch-invariant mode: float32 on CPU is batch-variant; the batch-invariant runner is not."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from replay.bisect.batch import bisect_batch
from replay.cli import app
from replay.engine.batch_invariant import enable
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.engine.weights import tiny_model
from replay.provenance import set_torch_threads
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic
from replay.record.stress import stress
from replay.replayer import replay_capture

PROMPT = list(range(10, 40))


def test_default_mode_gives_several_logprob_sequences_and_batch_invariant_exactly_one():
    set_torch_threads(1)
    default = stress(PROMPT, EngineConfig(runner=RunnerConfig(num_threads=1)), trials=8, seed=1)
    assert default.unique_logprob_sequences > 1 and default.first_fork is not None
    assert default.first_fork.batch_sizes[0] != default.first_fork.batch_sizes[1] or \
        default.first_fork.batch_tokens[0] != default.first_fork.batch_tokens[1]
    invariant = stress(PROMPT, EngineConfig(runner=RunnerConfig(num_threads=1, batch_invariant=True)), trials=8, seed=1)
    assert invariant.unique_logprob_sequences == 1 and invariant.unique_completions == 1
    assert invariant.first_fork is None


def test_stress_trials_in_local_processes_give_the_serial_answer():
    from replay.processes.fanout import FanOut

    cfg = EngineConfig(runner=RunnerConfig(num_threads=1))
    serial = stress(PROMPT, cfg, trials=4, seed=3)
    fanned = stress(PROMPT, cfg, trials=4, seed=3, how=FanOut(jobs=2))
    assert fanned == serial  # every trial's co-batching is drawn up front, so the same trials run


def test_stress_in_an_environment_of_its_own_runs_there_and_refuses_other_knobs():
    cfg = EngineConfig(runner=RunnerConfig(num_threads=1))
    serial = stress(PROMPT, cfg, trials=3, seed=3)
    assert stress(PROMPT, cfg, trials=3, seed=3, env={"OMP_WAIT_POLICY": "PASSIVE"}) == serial  # a fresh process
    out = CliRunner().invoke(app, ["stress", "--prompt-token-ids", "5,6,7", "--set", "dtype=float64"])
    assert out.exit_code == 2 and "stress runs the builtin engine" in out.output
    out = CliRunner().invoke(app, ["stress", "--prompt-token-ids", "5,6,7", "--neighbours", "5:1"])
    assert out.exit_code == 2 and "--neighbours '5:1': expected 0 <= MIN <= MAX" in out.output


def test_batch_invariant_linear_gives_a_row_the_same_bits_whatever_the_batch():
    m, _, _ = tiny_model()
    enable(m)
    x = torch.randn(11, 128, generator=torch.Generator().manual_seed(0))
    full = m.layers[0].mlp.gate_proj(x)
    for i in (0, 5, 10):
        assert torch.equal(m.layers[0].mlp.gate_proj(x[i:i + 1])[0], full[i])


def test_bisect_batch_finds_a_batch_invariant_capture_invariant(tmp_path):
    wl = SyntheticWorkload(num_requests=8, prompt_len=(8, 20), output_len=(6, 10), arrival_rate=0, sampling="greedy",
                           num_logprobs=2, seed=3)
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=8, num_gpu_blocks=64, max_num_batched_tokens=48),
                       runner=RunnerConfig(num_threads=1, batch_invariant=True))
    path = record_builtin(RecordOptions(cfg, synthetic(wl, 512), tmp_path / "bi.capture")).path
    assert not replay_capture(path).diverged  # the knob is recorded and replayed
    res = bisect_batch(path, 4, "req-0")
    assert res.batch_invariant and all(p.same_as_alone for p in res.padding)


def test_stress_cli():
    res = CliRunner().invoke(app, ["stress", "--prompt-token-ids", "5,6,7,8,9", "--trials", "3", "-q",
                                   "--batch-invariant", "--json"])
    assert res.exit_code == 0 and '"unique_logprob_sequences":1' in res.stdout
    res = CliRunner().invoke(app, ["stress", "--trials", "3"])
    assert res.exit_code == 2 and "exactly one of" in res.stderr


def test_a_fork_in_batches_of_one_size_points_at_the_steps_before():
    from replay.cli.render_replay import render_stress
    from replay.record.stress import Fork, StressReport

    def said(sizes, tokens) -> str:
        fork = Fork(14, "token", [0, 3], sizes, tokens)
        return render_stress(StressReport(4, 2, 2, fork, False, "4 replays")).splitlines()[1]

    assert said([1, 1], [1, 1]).endswith("batches of the same size in both (1 requests, 1 tokens): what parted them "
                                         "came in the steps before")
    assert said([1, 3], [1, 3]).endswith("the target ran in batches of 1 and 3 requests (1 and 3 tokens)")
