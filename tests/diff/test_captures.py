"""replay diff A B: requests aligned across separately recorded runs; batch variance vs run-to-run suspects."""

from __future__ import annotations

from typer.testing import CliRunner

from replay.cli import app
from replay.diff import diff_captures
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic

WL = SyntheticWorkload(num_requests=8, prompt_len=(20, 60), output_len=(6, 12), arrival_rate=0, sampling="greedy",
                       num_logprobs=5, seed=21)


def _record(tmp_path, name, budget, dtype="float32"):
    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=budget, block_size=8, num_gpu_blocks=256),
                       runner=RunnerConfig(num_threads=1, dtype=dtype))
    return record_builtin(RecordOptions(cfg, synthetic(WL, 512), tmp_path / f"{name}.capture")).path


def test_same_run_twice_matches(tmp_path):
    a, b = _record(tmp_path, "a", 64), _record(tmp_path, "b", 64)
    res = diff_captures(a, b)
    assert not res.diverged and res.requests_compared == 8


def test_another_token_budget_shows_differing_batches(tmp_path):
    a, b = _record(tmp_path, "a", 64), _record(tmp_path, "b", 37)
    res = diff_captures(a, b)
    assert res.diverged, "fp32 chunking changes GEMM shapes: some logprob bits must differ"
    d = res.first_divergence
    assert d.batches_differ and d.suspect == "batch variance"
    assert d.a_batch.num_scheduled_tokens != d.b_batch.num_scheduled_tokens
    out = CliRunner().invoke(app, ["diff", str(a), str(b)])
    assert out.exit_code == 1 and "batches DIFFER: suspect batch variance" in out.stdout
    # within a tolerance the two runs agree
    from replay.diff import Tolerance

    assert not diff_captures(a, b, Tolerance(atol=1e-4)).diverged


def test_another_dtype_flips_tokens(tmp_path):
    a, b = _record(tmp_path, "a", 64), _record(tmp_path, "b", 64, dtype="bfloat16")
    res = diff_captures(a, b)
    assert res.diverged and res.first_divergence.suspect == "configuration (dtype: float32 vs bfloat16)"
    assert "dtype: float32 vs bfloat16" in res.config_differences


def test_cli_diff_errors(tmp_path):
    res = CliRunner().invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    assert res.exit_code == 2 and "no such file" in res.stderr
