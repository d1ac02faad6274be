"""Step codec: request-id interning and the lossless logprob transforms."""

from __future__ import annotations

import numpy as np
import pytest
from msgspec.structs import replace

from replay.capture.codec.stepcodec import (
    FILTER_COL0,
    FILTER_COL0_XOR,
    step_from_wire,
    step_to_wire,
)
from replay.capture.format import records as fmt
from replay.capture.format.ids import IdTable, UnknownHandleError
from replay.capture.format.records import AlignedStep, PackedStep, Step
from replay.contracts import (
    Array,
    CachedRequestData,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)


def _decode_step(ids: list[str], sampled: list[list[int]], lp_ids: np.ndarray, lp_vals: np.ndarray) -> Step:
    so = SchedulerOutput([], CachedRequestData(ids, set(), [], {}, [None] * len(ids), [5] * len(ids), [1] * len(ids)),
                         {r: 1 for r in ids}, len(ids), {}, {}, {"done"}, [])
    lp = LogprobsLists(Array.from_numpy(lp_ids), Array.from_numpy(lp_vals),
                       Array.from_numpy(np.ones(len(lp_ids), np.int64)))
    return Step(0, so, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled, lp))


def test_ids_are_stored_once_as_handles_and_restored():
    table = IdTable()
    step = _decode_step(["a", "b"], [[7], [8]], np.array([[7, 7, 1], [8, 2, 8]], np.int32),
                        np.zeros((2, 3), np.float32))
    wire = step_to_wire(step, table)
    assert wire.scheduler_output.scheduled_cached_reqs.req_ids == [0, 1]
    assert wire.scheduler_output.finished_req_ids == {2}
    decl = table.take_new()
    assert (decl.first, decl.ids) == (0, ["a", "b", "done"])
    assert table.take_new() is None
    reader = IdTable()
    reader.declare(decl)
    assert step_from_wire(wire, reader) == step


def test_unknown_handle_is_an_error_not_a_wrong_id():
    wire = step_to_wire(_decode_step(["a"], [[1]], np.array([[1, 1]], np.int32), np.zeros((1, 2), np.float32)),
                        IdTable())
    with pytest.raises(UnknownHandleError):
        step_from_wire(wire, IdTable())


def test_greedy_logprob_columns_store_as_zeros():
    rng = np.random.default_rng(0)
    n, k = 64, 5
    ids = rng.integers(0, 50_000, size=(n, k + 1)).astype(np.int32)
    ids[:, 0] = ids[:, 1]  # greedy: sampled token == top-1
    vals = -rng.exponential(2.0, size=(n, k + 1)).astype(np.float32)
    vals[:, 0] = vals[:, 1]
    step = _decode_step([f"r{i}" for i in range(n)], [[int(t)] for t in ids[:, 0]], ids, vals)
    wire = step_to_wire(step, IdTable()).model_runner_output.logprobs
    assert FILTER_COL0 in wire.logprob_token_ids.filters and FILTER_COL0_XOR in wire.logprobs.filters
    # column 0 is stored first (transposed): n zero ids and n zero value bit patterns, in every byte plane
    stored_ids = np.frombuffer(wire.logprob_token_ids.data, np.uint8).reshape(4, -1)[:, :n]
    assert not stored_ids.any()
    stored_vals = np.frombuffer(wire.logprobs.data, np.uint8).reshape(4, -1)[:, :n]
    assert not stored_vals.any()


def test_partial_prefill_rows_and_misaligned_rows_round_trip():
    table = IdTable()
    # row 1 sampled nothing (partial prefill) but vLLM still gives it a logprob row
    ids = np.array([[5, 5, 9], [42, 1, 2], [6, 3, 6]], np.int32)
    vals = np.array([[-0.5, -0.5, -1], [-2, -0.1, -0.2], [-3, -0.4, -3]], np.float32)
    step = _decode_step(["a", "b", "c"], [[5], [], [6]], ids, vals)
    reader = IdTable()
    wire = step_to_wire(step, table)
    reader.declare(table.take_new())
    assert step_from_wire(wire, reader) == step
    # rows that do not line up with the sampled tokens at all are stored unpredicted
    odd = _decode_step(["a", "b"], [[1, 2, 3], []], ids[:2], vals[:2])
    wire = step_to_wire(odd, table)
    assert FILTER_COL0 not in wire.model_runner_output.logprobs.logprob_token_ids.filters
    assert step_from_wire(wire, reader) == odd


def test_nan_and_signed_zero_logprobs_keep_their_bits():
    vals = np.array([[np.nan, np.nan, -np.inf], [-0.0, 0.0, -0.0]], np.float32)
    vals.view(np.uint32)[0, 0] = 0x7FC00123  # a NaN payload
    ids = np.array([[1, 1, 2], [3, 4, 3]], np.int32)
    step = _decode_step(["a", "b"], [[1], [3]], ids, vals)
    t = IdTable()
    wire = step_to_wire(step, t)
    r = IdTable()
    r.declare(t.take_new())
    back = step_from_wire(wire, r).model_runner_output.logprobs.logprobs.to_numpy()
    assert back.tobytes() == vals.tobytes()


def _round_trip(step: Step) -> Step:
    table, reader = IdTable(), IdTable()
    wire = step_to_wire(step, table)
    reader.declare(table.take_new())
    back = step_from_wire(fmt.WIRE_DECODER.decode(fmt.WIRE_ENCODER.encode(wire)), reader)
    assert back == step
    assert [list(m) for m in _maps(back)] == [list(m) for m in _maps(step)]  # key order too, not only contents
    return wire


def _maps(step: Step) -> tuple:
    mro = step.model_runner_output
    return step.scheduler_output.num_scheduled_tokens, {} if mro is None else mro.req_id_to_index


def test_maps_in_batch_order_are_stored_as_lists_and_come_back_in_their_order():
    ids = [f"r{i}" for i in range(5)]
    step = _decode_step(ids, [[1]] * 5, np.ones((5, 2), np.int32), np.zeros((5, 2), np.float32))
    so = step.scheduler_output
    new = replace(so.scheduled_cached_reqs, req_ids=ids[:3], num_computed_tokens=[5] * 3, num_output_tokens=[1] * 3,
                  new_block_ids=[None] * 3)
    step = replace(step, scheduler_output=replace(so, scheduled_cached_reqs=new, scheduled_new_reqs=[
        _new_req("r3"), _new_req("r4")], num_scheduled_tokens={"r0": 1, "r1": 1, "r2": 1, "r3": 7, "r4": 9}))
    wire = _round_trip(step)
    assert isinstance(wire, AlignedStep) and wire.num_scheduled == [1, 1, 1, 7, 9]
    assert wire.elided == fmt.COMPUTED_MINUS_OUTPUT | fmt.OUTPUT_IDS_IN_BATCH_ORDER | fmt.OUTPUT_INDEX_IN_ORDER
    assert wire.scheduler_output.num_scheduled_tokens == {} and wire.model_runner_output.req_ids == []
    assert wire.model_runner_output.req_id_to_index == {}


def test_maps_in_another_order_are_stored_whole():
    ids = ["a", "b", "c"]
    step = _decode_step(ids, [[1], [2], [3]], np.ones((3, 2), np.int32), np.zeros((3, 2), np.float32))
    so, mro = step.scheduler_output, step.model_runner_output
    # scheduled in another order, output ids in another order, an index that is not the enumeration of the ids
    odd = replace(step, scheduler_output=replace(so, num_scheduled_tokens={"b": 1, "a": 1, "c": 1}),
                  model_runner_output=replace(mro, req_ids=["c", "a", "b"], req_id_to_index={"c": 0, "a": 2, "b": 1}))
    wire = _round_trip(odd)
    assert wire.num_scheduled is None and wire.elided == fmt.COMPUTED_MINUS_OUTPUT
    assert list(wire.scheduler_output.num_scheduled_tokens.values()) == [1, 1, 1]
    assert wire.model_runner_output.req_ids == [2, 0, 1]
    # only the index line up: the ids are stored, the index is left out
    wire = _round_trip(replace(odd, model_runner_output=replace(mro, req_ids=["c", "a", "b"],
                                                                req_id_to_index={"c": 0, "a": 1, "b": 2})))
    assert wire.elided == fmt.COMPUTED_MINUS_OUTPUT | fmt.OUTPUT_INDEX_IN_ORDER
    # a step with nothing to align or pack is a plain Step
    bare = replace(step, scheduler_output=replace(so, num_scheduled_tokens={"b": 1, "a": 1, "c": 1},
                   scheduled_cached_reqs=replace(so.scheduled_cached_reqs, num_computed_tokens=[])),
                   model_runner_output=None)
    assert type(_round_trip(bare)) is Step


def test_a_format_1_3_packed_step_still_reads():
    step = _decode_step(["a", "b"], [[7], [8]], np.array([[7, 7, 1], [8, 2, 8]], np.int32),
                        np.zeros((2, 3), np.float32))
    table, reader = IdTable(), IdTable()
    wire = step_to_wire(replace(step, model_runner_output=None), table)  # handles, as a 1.3 writer gave them
    cr = wire.scheduler_output.scheduled_cached_reqs
    so = replace(wire.scheduler_output, num_scheduled_tokens={0: 1, 1: 1})
    old = PackedStep(0, so, None)  # 1.3: only the computed-token counts packed (they are already: 5 - 1 each)
    assert cr.num_computed_tokens == [4, 4]
    reader.declare(table.take_new())
    back = step_from_wire(fmt.WIRE_DECODER.decode(fmt.WIRE_ENCODER.encode(old)), reader)
    assert back == replace(step, model_runner_output=None)


def test_an_aligned_step_that_cannot_line_up_is_an_error_not_a_wrong_step():
    step = _decode_step(["a", "b"], [[7], [8]], np.ones((2, 2), np.int32), np.zeros((2, 2), np.float32))
    table, reader = IdTable(), IdTable()
    wire = step_to_wire(step, table)
    reader.declare(table.take_new())
    with pytest.raises(ValueError, match="line up"):
        step_from_wire(replace(wire, num_scheduled=[1, 1, 1]), reader)
    with pytest.raises(ValueError, match="both stored and left out"):
        step_from_wire(replace(wire, model_runner_output=replace(wire.model_runner_output, req_ids=[1, 0])), reader)


def _new_req(rid: str):
    from replay.contracts import NewRequestData, SamplingParams

    return NewRequestData(rid, [1, 2, 3], [], SamplingParams(), None, ([0],), 0, None)
