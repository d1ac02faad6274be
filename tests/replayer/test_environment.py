"""`--set env.NAME=VALUE`: the replay runs in a fresh process started with it, says so, and `bisect config` finds
the one environment variable that changes numerics among several that do not."""

from __future__ import annotations

import os

import pytest

from replay.bisect.config import bisect_config
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.errors import CaptureDamagedError, UsageError
from replay.processes.in_environment import Environments, in_environment
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic
from replay.replayer import ReplayOptions, build_runner, replay_capture


def _environ(name: str) -> str | None:
    return os.environ.get(name)


def _damaged(path: str) -> None:
    raise CaptureDamagedError(path, "chunk 3 is cut short", chunk=3)


def test_a_function_runs_in_a_fresh_process_with_the_variables_set_and_this_one_keeps_its_own():
    os.environ.pop("REPLAY_TEST_ENV", None)
    assert in_environment({"REPLAY_TEST_ENV": "on"}, _environ, "REPLAY_TEST_ENV") == "on"
    assert "REPLAY_TEST_ENV" not in os.environ
    os.environ["REPLAY_TEST_ENV"] = "kept"
    try:
        assert in_environment({"REPLAY_TEST_ENV": None}, _environ, "REPLAY_TEST_ENV") is None  # None: unset
        assert os.environ["REPLAY_TEST_ENV"] == "kept"
    finally:
        del os.environ["REPLAY_TEST_ENV"]


def test_an_error_of_ours_comes_back_as_itself_with_its_exit_code():
    with pytest.raises(CaptureDamagedError, match="x.capture \\(chunk 3\\): chunk 3 is cut short") as e:
        in_environment({"REPLAY_TEST_ENV": "1"}, _damaged, "x.capture")
    assert e.value.exit_code == 3


def _pid_and(name: str) -> tuple[int, str | None]:
    return os.getpid(), os.environ.get(name)


def test_the_calls_that_share_an_environment_share_its_process():
    """A bisect's tests with the same env.* knobs run in one process (which keeps its engine between them); another
    setting gets another process; the caller's environment is untouched."""
    with Environments() as envs:
        a1 = envs.call({"REPLAY_TEST_ENV": "a"}, _pid_and, "REPLAY_TEST_ENV")
        b = envs.call({"REPLAY_TEST_ENV": "b"}, _pid_and, "REPLAY_TEST_ENV")
        a2 = envs.call({"REPLAY_TEST_ENV": "a"}, _pid_and, "REPLAY_TEST_ENV")
    assert a1 == a2 and a1[1] == "a" and b[1] == "b" and b[0] != a1[0] != os.getpid()
    assert "REPLAY_TEST_ENV" not in os.environ


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    wl = SyntheticWorkload(num_requests=6, prompt_len=(8, 40), output_len=(4, 8), arrival_rate=0, sampling="greedy",
                           num_logprobs=2, seed=5)
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=8, num_gpu_blocks=64, max_num_seqs=6),
                       runner=RunnerConfig(num_threads=1))
    path = tmp_path_factory.mktemp("env") / "env.capture"
    record_builtin(RecordOptions(cfg, synthetic(wl, 512), path))
    return path


def test_a_replay_with_an_environment_knob_names_it_and_matches_where_it_changes_nothing(capture):
    rep = replay_capture(capture, ReplayOptions(overrides={"env.OMP_WAIT_POLICY": "PASSIVE", "env.REPLAY_MARK": "1"}))
    assert not rep.diverged
    assert "OMP_WAIT_POLICY: recorded -, replay PASSIVE" in rep.environment_differences  # as the child's header says
    assert "REPLAY_MARK: recorded unset, replay 1" in rep.environment_differences


def test_a_runner_cannot_start_with_an_environment_it_was_not_started_in(capture):
    from replay.capture import CaptureReader

    with CaptureReader(capture) as r, pytest.raises(UsageError, match="environment knobs apply to a fresh process"):
        build_runner(r.header, {"env.MKL_CBWR": "COMPATIBLE"})


def test_bisect_config_finds_the_environment_variable_that_changes_numerics_among_several(capture):
    if not replay_capture(capture, ReplayOptions(overrides={"env.MKL_CBWR": "COMPATIBLE"})).diverged:
        pytest.skip("MKL_CBWR=COMPATIBLE runs the same GEMM code path on this CPU: nothing to find")
    bad = "env.OMP_WAIT_POLICY=PASSIVE,env.MKL_CBWR=COMPATIBLE,env.KMP_BLOCKTIME=0,env.TOKENIZERS_PARALLELISM=false"
    res = bisect_config(capture, "", bad)
    assert res.minimal_change == {"env.MKL_CBWR": "COMPATIBLE"}, res.verdict
    assert "changing env.MKL_CBWR=COMPATIBLE alone" in res.verdict
