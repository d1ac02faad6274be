"""`--tolerance auto`: bitwise on the recording's hardware; on other hardware (or hardware the recording does not
name) equal tokens and logprobs within the measured cross-hardware tolerance; it always says which it took. The
"other hardware" here is a recording whose header names other CPU features: a second processor cannot exist in one
test run, and the header is all the choice reads."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from replay.capture import CaptureReader, CaptureWriter
from replay.cli import app
from replay.diff import diff_captures
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.provenance.hardware import KERNEL_ISA
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic
from replay.replayer import ReplayOptions, check_capture, replay_capture
from replay.replayer.tolerance import CROSS_HARDWARE_ATOL

cli = CliRunner()


def _record(path: Path, dtype: str = "float32") -> Path:
    cfg = EngineConfig(model="tiny", scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                       runner=RunnerConfig(dtype=dtype, num_threads=1, seed=3))
    wl = SyntheticWorkload(num_requests=4, prompt_len=(8, 20), output_len=(4, 8), sampling="greedy", num_logprobs=3,
                           seed=2)
    record_builtin(RecordOptions(cfg, synthetic(wl, vocab_size=512), path, overwrite=True))
    return path


def _rewritten(src: Path, dst: Path, engine_config=None, **environment) -> Path:
    """`src` with its header's environment (and engine config) changed, as if recorded elsewhere."""
    with CaptureReader(src) as r:
        header = msgspec.structs.replace(r.header, environment=msgspec.structs.replace(r.header.environment,
                                                                                       **environment),
                                         engine_config=engine_config or r.header.engine_config)
        with CaptureWriter(dst, header) as w:
            for rec in r.records():
                w.write_record(rec)
    return dst


@pytest.fixture(scope="module")
def here(tmp_path_factory) -> Path:
    return _record(tmp_path_factory.mktemp("tol") / "here.capture")


def test_on_the_recordings_hardware_auto_is_bitwise(here):
    res = check_capture(here, ReplayOptions(auto_tolerance=True))
    assert res.code == 0 and res.report.tolerance.bitwise
    assert res.report.tolerance_choice.startswith("bitwise: replayed on the recording's hardware")


def test_on_other_hardware_auto_takes_the_cross_hardware_tolerance_and_names_the_difference(here, tmp_path):
    hw = _hardware(here)
    lacked = next(f for f in KERNEL_ISA if f not in hw.get("cpu_isa", "").split())  # whatever this processor lacks
    hw["cpu_isa"] = hw.get("cpu_isa", "") + f" {lacked}"
    moved = _rewritten(here, tmp_path / "moved.capture", hardware=hw)
    rep = replay_capture(moved, ReplayOptions(auto_tolerance=True))
    assert not rep.diverged and rep.tolerance.atol == CROSS_HARDWARE_ATOL["float32"]
    assert f"CPU features: recorded {lacked}, replay none" in rep.tolerance_choice
    assert rep.environment_differences[0] == f"CPU features: recorded {lacked}, replay none"  # the leading suspect
    bitwise = replay_capture(moved)  # without auto: the same bits still compare bitwise (same machine, in truth)
    assert not bitwise.diverged and bitwise.tolerance.bitwise


def test_a_recording_that_does_not_name_its_hardware_gets_the_tolerance_and_says_why(here, tmp_path):
    old = _rewritten(here, tmp_path / "old.capture", hardware={}, libraries={})
    res = check_capture(old, ReplayOptions(auto_tolerance=True))
    assert res.code == 0 and "does not name its hardware" in res.reason and "atol 0.0001" in res.reason


def test_auto_still_finds_a_real_divergence(here):
    rep = replay_capture(here, ReplayOptions(auto_tolerance=True, overrides={"dtype": "bfloat16"}))
    assert rep.diverged and rep.tolerance.bitwise  # bfloat16 on the same hardware: far outside any tolerance


def test_the_command_line_says_which_tolerance_it_took(here):
    res = cli.invoke(app, ["check", str(here), "--tolerance", "auto"])
    assert res.exit_code == 0 and "tolerance bitwise: replayed on the recording's hardware" in res.stderr
    run = cli.invoke(app, ["run", str(here), "--diff", "--tolerance", "auto"])
    assert run.exit_code == 0 and "tolerance auto: bitwise" in run.stdout
    for bad in (["--tolerance", "auto", "--atol", "1e-3"], ["--tolerance", "fuzzy"]):
        res = cli.invoke(app, ["run", str(here), "--diff", *bad])
        assert res.exit_code == 2 and "--tolerance" in res.stderr, res.stderr


def test_diff_names_hardware_as_the_suspect(here, tmp_path):
    bf16 = _record(tmp_path / "bf16.capture", "bfloat16")
    elsewhere = _rewritten(bf16, tmp_path / "elsewhere.capture",
                           hardware=dict(_hardware(here), cpu_model="Some Other CPU"))
    res = diff_captures(here, elsewhere)
    assert res.diverged and res.first_divergence.suspect.startswith("hardware (processor: ")


def test_a_layout_the_replay_does_not_have_is_named_before_the_verdict(here, tmp_path):
    """A tensor-parallel recording replayed on one worker: the note names the knob (the header stands in for a
    TP=2 recording; replaying through vLLM's executor on the recorded layout is not built yet)."""
    with CaptureReader(here) as r:
        engine_config = msgspec.structs.replace(r.header.engine_config,
                                                layout=dict(r.header.engine_config.layout, tensor_parallel_size="2"))
    tp2 = _rewritten(here, tmp_path / "tp2.capture", engine_config=engine_config)
    rep = replay_capture(tp2)
    assert rep.environment_differences[0] == "tensor_parallel_size: recorded 2, replay 1"


def _hardware(path: Path) -> dict[str, str]:
    with CaptureReader(path) as r:
        return dict(r.header.environment.hardware)


def test_on_another_runner_auto_takes_the_tolerance_and_names_the_runner(here, tmp_path):
    vllms = "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
    with CaptureReader(here) as r:
        ec = msgspec.structs.replace(r.header.engine_config, runner_class=vllms)
    other = _rewritten(here, tmp_path / "other-runner.capture", engine_config=ec)
    res = check_capture(other, ReplayOptions(auto_tolerance=True))
    assert res.code == 0 and not res.report.tolerance.bitwise, res.reason
    assert res.report.tolerance.atol == CROSS_HARDWARE_ATOL["float32"]
    assert f"another implementation: runner: recorded {vllms}" in res.reason
