"""Another engine's objects, or their msgpack image, into our contracts: tolerant of drift, exact on arrays."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import msgspec
import numpy as np

from replay.contracts import (
    Array,
    ModelRunnerOutput,
    Opaque,
    SamplingParams,
    SchedulerOutput,
)
from replay.contracts.tolerant import TolerantConverter


class TheirLogprobs(NamedTuple):  # vLLM's LogprobsLists is a NamedTuple of ndarrays
    logprob_token_ids: np.ndarray
    logprobs: np.ndarray
    sampled_token_ranks: np.ndarray
    cu_num_generated_tokens: list[int] | None


@dataclasses.dataclass
class TheirOutput:  # a ModelRunnerOutput as a newer vLLM might send it: one field we do not know
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: TheirLogprobs | None
    prompt_logprobs_dict: dict
    brand_new_field: int = 7


def _their_output():
    ids = np.array([[5, 5, 9], [42, 1, 2]], np.int32)
    vals = np.array([[-0.1, -0.1, -2.5], [-3.0, -0.5, -1.0]], np.float32)
    return TheirOutput(["a", "b"], {"a": 0, "b": 1}, [[5], [42]],
                       TheirLogprobs(ids, vals, np.array([0, 3], np.int32), None), {}), ids, vals


def test_live_objects_convert_field_by_field_with_arrays_bit_exact():
    conv = TolerantConverter()
    theirs, ids, vals = _their_output()
    ours = conv.convert(theirs, ModelRunnerOutput[str])
    assert ours.req_ids == ["a", "b"] and ours.sampled_token_ids == [[5], [42]]
    assert np.array_equal(ours.logprobs.logprob_token_ids.to_numpy(), ids)
    assert ours.logprobs.logprobs.to_numpy().tobytes() == vals.tobytes()
    assert conv.unknown_fields == {"TheirOutput": {"brand_new_field"}}


def test_msgpack_images_convert_like_the_objects():
    def hook(x):
        return Array.from_numpy(x) if isinstance(x, np.ndarray) else Opaque.of(x)

    theirs, _, _ = _their_output()
    image = msgspec.msgpack.decode(msgspec.msgpack.Encoder(enc_hook=hook).encode(theirs))
    assert isinstance(image, dict) and isinstance(image["logprobs"], list)  # dataclass -> map, NamedTuple -> array
    from_image = TolerantConverter().convert(image, ModelRunnerOutput[str])
    assert from_image == TolerantConverter().convert(theirs, ModelRunnerOutput[str])


def test_private_spellings_fill_public_fields_and_defaults_fill_gaps():
    image = {"temperature": 0.7, "seed": 3, "_eos_token_id": 2, "_all_stop_token_ids": [2, 9], "stop": "END",
             "output_kind": 2, "watermarking": False}
    conv = TolerantConverter()
    sp = conv.convert(image, SamplingParams)
    assert (sp.temperature, sp.seed, sp.eos_token_id) == (0.7, 3, 2)
    assert set(sp.all_stop_token_ids) == {2, 9} and sp.stop == ["END"]
    assert sp.top_p == SamplingParams().top_p  # absent: our default, which is vLLM's
    assert "watermarking" in conv.unknown_fields["SamplingParams"]


def test_what_we_cannot_represent_becomes_an_opaque_summary():
    class Connector:
        pass

    image = {"scheduled_new_reqs": [], "scheduled_cached_reqs": {"req_ids": [], "resumed_req_ids": []},
             "num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0, "scheduled_spec_decode_tokens": {},
             "scheduled_encoder_inputs": {}, "finished_req_ids": ["x"], "free_encoder_mm_hashes": [],
             "kv_connector_metadata": {"blocks": [1, 2]}}  # a connector dataclass we do not mirror, as a map
    so = TolerantConverter().convert(image, SchedulerOutput[str])
    assert so.finished_req_ids == {"x"} and isinstance(so.kv_connector_metadata, Opaque)
    assert so.preempted_req_ids is None  # absent stays absent
    assert isinstance(TolerantConverter().convert(Connector(), Opaque), Opaque)
