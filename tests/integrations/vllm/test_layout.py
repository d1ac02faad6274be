"""The recorded layout as vLLM's `LLM` arguments, and the `--set` layout knobs (no vLLM needed: pure functions)."""

from __future__ import annotations

import os

import pytest

from replay.capture import EngineConfig
from replay.errors import UsageError
from replay.integrations.vllm.layout import (
    check_layout_knob,
    engine_layout_kwargs,
    omp_threads_bind,
    recorded_layout,
)
from replay.replayer import parse_overrides

TP2 = EngineConfig(layout={"tensor_parallel_size": "2", "pipeline_parallel_size": "1", "data_parallel_size": "1",
                           "distributed_executor_backend": "mp", "compilation_mode": "NONE", "cudagraph_mode": "NONE",
                           "enforce_eager": "True", "attention_backend": "CPU_ATTN"})


def test_a_tp2_capture_builds_two_workers_on_the_recorded_backend_eager():
    kw = engine_layout_kwargs(TP2, {})
    assert kw == {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "enforce_eager": True,
                  "distributed_executor_backend": "mp"}  # the selected backend is recorded, not asked for


def test_set_knobs_win_and_one_worker_needs_no_executor_backend():
    kw = engine_layout_kwargs(TP2, {"tensor_parallel_size": "1", "runner": "vllm"})
    assert kw["tensor_parallel_size"] == 1 and "distributed_executor_backend" not in kw
    kw = engine_layout_kwargs(TP2, {"distributed_executor_backend": "ray"})
    assert kw["distributed_executor_backend"] == "ray"


def test_a_compiled_recording_is_rebuilt_compiled_with_its_cudagraph_mode():
    ec = EngineConfig(layout={"enforce_eager": "False", "compilation_mode": "VLLM_COMPILE",
                              "cudagraph_mode": "FULL_AND_PIECEWISE"}, attention_impl="FLASH_ATTN")
    kw = engine_layout_kwargs(ec, {})
    assert kw["enforce_eager"] is False and kw["attention_backend"] == "FLASH_ATTN"
    assert kw["compilation_config"] == {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert "compilation_config" not in engine_layout_kwargs(ec, {"enforce_eager": "true"})


def test_captures_without_a_layout_replay_as_before_one_eager_worker():
    assert engine_layout_kwargs(EngineConfig(), {}) == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                                        "enforce_eager": True}
    assert recorded_layout(EngineConfig(), {"attention_backend": "TORCH_SDPA"}) == {"attention_backend": "TORCH_SDPA"}
    builtin = EngineConfig(attention_impl="sdpa", layout={"tensor_parallel_size": "1"})  # not a vLLM backend name
    assert "attention_backend" not in engine_layout_kwargs(builtin, {}, engine="builtin")


def test_cpu_workers_get_a_thread_binding_of_this_machines_cpus(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cpus = sorted(os.sched_getaffinity(0))
    layout = {"tensor_parallel_size": "2"}
    bind = omp_threads_bind(layout, {}, "cpu")
    if len(cpus) < 2:
        assert bind is None
    else:
        first, second = bind.split("|")
        assert first.split("-")[0] == str(cpus[0]) and second.split("-")[-1] == str(cpus[2 * (len(cpus) // 2) - 1])
    assert omp_threads_bind(layout, {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[0]}"},
                            "cpu") == f"{cpus[0]}|{cpus[0]}"
    assert omp_threads_bind(layout, {"VLLM_CPU_OMP_THREADS_BIND": "9990|9991"}, "cpu") != "9990|9991"  # not ours
    assert omp_threads_bind({"tensor_parallel_size": "1"}, {}, "cpu") is None
    assert omp_threads_bind(layout, {}, "cuda") is None
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert omp_threads_bind(layout, {}, "cpu") is None  # the user's own setting stands


@pytest.mark.parametrize("key,value,expected", [
    ("tensor_parallel_size", "04", "4"), ("compilation_mode", "3", "VLLM_COMPILE"),
    ("compilation_mode", "none", "NONE"), ("distributed_executor_backend", "ray", "ray"),
])
def test_layout_knob_values_are_normalised(key, value, expected):
    assert check_layout_knob(key, value) == expected


@pytest.mark.parametrize("key,value", [("tensor_parallel_size", "0"), ("pipeline_parallel_size", "two"),
                                       ("compilation_mode", "7"), ("distributed_executor_backend", "slurm")])
def test_bad_layout_knob_values_say_what_they_expect(key, value):
    with pytest.raises(ValueError, match="expected"):
        check_layout_knob(key, value)


def test_layout_knobs_need_vllms_runner():
    assert parse_overrides(["runner=vllm", "tensor-parallel-size=1", "compilation_mode=0"]) == {
        "runner": "vllm", "tensor_parallel_size": "1", "compilation_mode": "NONE"}
    with pytest.raises(UsageError, match="tensor_parallel_size: a vLLM layout knob; it needs vLLM's runner"):
        parse_overrides(["tensor_parallel_size=2"])
