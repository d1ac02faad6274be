"""EngineOptions: the knobs a user gave, turned into an engine configuration in one place. What is not given takes
the engine's own default, so `replay record`, `replay demo` and the library agree."""

from __future__ import annotations

import pytest

from replay.capture import CaptureReader
from replay.cli import main
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.errors import UsageError
from replay.record import EngineOptions, builtin_config


def test_nothing_given_is_the_engines_own_configuration():
    assert builtin_config(EngineOptions()) == EngineConfig()


def test_each_given_knob_changes_only_itself():
    cfg = builtin_config(EngineOptions(max_num_batched_tokens=64, threads=1, enable_prefix_caching=False))
    assert cfg.scheduler == SchedulerConfig(max_num_batched_tokens=64, enable_prefix_caching=False)
    assert cfg.runner == RunnerConfig(num_threads=1)


@pytest.mark.parametrize("options,flag", [
    (EngineOptions(engine="vllm", model="/m", threads=2), "--threads"),
    (EngineOptions(engine="vllm", model="/m", attention="reference"), "--attention"),
    (EngineOptions(engine="vllm"), "--model PATH"),
    (EngineOptions(engine="tensorrt"), "--engine 'tensorrt'"),
])
def test_what_an_engine_cannot_take_is_refused_by_name(options, flag):
    with pytest.raises(UsageError, match=flag.replace("'", ".")):
        options.check()


def test_the_cli_records_with_the_engines_defaults(tmp_path, capsys):
    out = tmp_path / "d.capture"
    assert main(["record", "--num-requests", "2", "--output-len", "2:3", "--out", str(out)]) == 0
    with CaptureReader(out) as r:
        ec = r.header.engine_config
    defaults = SchedulerConfig()
    assert (ec.max_num_batched_tokens, ec.max_num_seqs, ec.block_size, ec.num_gpu_blocks, ec.max_model_len) == (
        defaults.max_num_batched_tokens, defaults.max_num_seqs, defaults.block_size, defaults.num_gpu_blocks,
        defaults.max_model_len)
