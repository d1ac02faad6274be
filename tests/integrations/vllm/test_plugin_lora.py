"""The plugin's wrappers of EngineCore's LoRA utility methods keep their signatures: EngineCoreProc converts a
utility call's msgspec-decoded arguments by the method's annotations (a LoRARequest arrives as a list), so a
server started with --lora-modules under REPLAY_CAPTURE failed at startup without them."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

from replay.integrations.vllm.plugin import install  # noqa: E402


def test_add_lora_as_a_utility_call_gets_its_lora_request_back():
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    install()
    bound = types.MethodType(EngineCore.add_lora, object())  # as EngineCoreProc looks the method up
    (arg,) = EngineCoreProc._convert_msgspec_args(bound, (["sql", 1, "/tmp/adapter"],))
    assert isinstance(arg, LoRARequest) and (arg.lora_name, arg.lora_int_id) == ("sql", 1)
