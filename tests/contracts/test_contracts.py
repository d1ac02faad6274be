"""Contracts: vLLM semantics of the enums and helpers, and bit-exact packed arrays."""

import numpy as np
import pytest
import torch

from replay.contracts import (
    Array,
    CachedRequestData,
    EngineCoreRequest,
    FinishReason,
    KVConnectorOutput,
    ModelRunnerOutput,
    Opaque,
    RequestStatus,
    SamplingParams,
    SamplingType,
    SchedulerOutput,
)


def test_request_status_is_finished_matches_vllm():
    assert not RequestStatus.is_finished(RequestStatus.RUNNING)
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert all(RequestStatus.is_finished(s) for s in RequestStatus if s.name.startswith("FINISHED_"))
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_IGNORED) == FinishReason.LENGTH
    assert RequestStatus.get_finished_reason(RequestStatus.RUNNING) is None
    assert str(FinishReason.STOP) == "stop"


def test_sampling_type_follows_temperature_and_seed():
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(logprob_token_ids=[1, 2]).num_logprobs == 2


def test_make_empty_and_helpers():
    so = SchedulerOutput.make_empty()
    assert so.total_num_scheduled_tokens == 0 and so.scheduled_req_ids() == []
    assert CachedRequestData.make_empty().num_reqs == 0
    mro = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[5], []])
    assert mro.sampled("a") == [5] and mro.sampled("b") == [] and mro.sampled("zz") == []
    assert KVConnectorOutput().is_empty() and not KVConnectorOutput(invalid_block_ids={3}).is_empty()


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
def test_float32_array_keeps_every_bit(shuffle, transpose):
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=(7, 5), dtype=np.uint64).astype(np.uint32)
    arr = bits.view(np.float32)  # includes NaN payloads and denormals
    back = Array.from_numpy(arr, shuffle=shuffle, transpose=transpose).to_numpy()
    assert back.shape == arr.shape and back.tobytes() == arr.tobytes()


def test_big_endian_input_is_stored_little_endian():
    arr = np.arange(6, dtype=">i4").reshape(2, 3)
    a = Array.from_numpy(arr)
    assert a.dtype == "int32" and a.data == np.arange(6, dtype="<i4").tobytes()
    assert (a.to_numpy() == arr).all()


def test_bfloat16_tensor_round_trips_through_torch():
    t = torch.randn(3, 4).to(torch.bfloat16)
    a = Array.from_torch(t)
    assert a.dtype == "bfloat16"
    assert torch.equal(a.to_torch(), t)


def test_array_validate_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match="needs 16 bytes"):
        Array("float32", (2, 2), b"\0" * 15).to_numpy()
    with pytest.raises(ValueError, match="unknown array dtype"):
        Array("complex64", (1,), b"\0" * 8).validate()
    with pytest.raises(ValueError, match="unknown array filter"):
        Array("int32", (1,), b"\0" * 4, ("rot13",)).validate()


def test_opaque_summarises_without_serialising():
    o = Opaque.of(torch.zeros(2, 3))
    assert o.type == "torch.Tensor" and o.size == 6 and "tensor" in o.summary


def test_the_children_of_an_n_request_are_named_apart_and_others_by_the_users_id():
    """vLLM names the child i of an n > 1 request `{i}_{parent's internal id}` and gives every child its parent's
    user id; reports must still tell the children apart."""
    def req(internal: str, external: str | None) -> EngineCoreRequest:
        return EngineCoreRequest(internal, [1, 2], None, SamplingParams(), None, 0.0, None, None, None,
                                 external_req_id=external)

    assert req("1_cmpl-ab12-0-1f2e3d4c", "cmpl-ab12-0").name == "cmpl-ab12-0#1"
    assert req("0_0-bf63b3db", "0").name == "0#0"  # LLM.generate's ids
    assert req("cmpl-ab12-0-1f2e3d4c", "cmpl-ab12-0").name == "cmpl-ab12-0"
    assert req("3_other-1f2e3d4c", "cmpl-ab12-0").name == "cmpl-ab12-0"  # not a child of that id
    assert req("req-7", None).name == "req-7"
