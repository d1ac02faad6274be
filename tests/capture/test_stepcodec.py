"""Step codec: request-id interning and the lossless logprob transforms."""

from __future__ import annotations

import numpy as np
import pytest

from replay.capture.format import Step
from replay.capture.stepcodec import (
    FILTER_COL0,
    FILTER_COL0_XOR,
    IdTable,
    UnknownHandleError,
    step_from_wire,
    step_to_wire,
)
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
    lp = LogprobsLists(Array.from_numpy(lp_ids), Array.from_numpy(lp_vals), Array.from_numpy(np.ones(len(lp_ids), np.int64)))
    return Step(0, so, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled, lp))


def test_ids_are_stored_once_as_handles_and_restored():
    table = IdTable()
    step = _decode_step(["a", "b"], [[7], [8]], np.array([[7, 7, 1], [8, 2, 8]], np.int32), np.zeros((2, 3), np.float32))
    wire = step_to_wire(step, table)
    assert wire.scheduler_output.scheduled_cached_reqs.req_ids == [0, 1]
    assert wire.model_runner_output.req_id_to_index == {0: 0, 1: 1}
    assert wire.scheduler_output.finished_req_ids == {2}
    decl = table.take_new()
    assert (decl.first, decl.ids) == (0, ["a", "b", "done"])
    assert table.take_new() is None
    reader = IdTable()
    reader.declare(decl)
    assert step_from_wire(wire, reader) == step


def test_unknown_handle_is_an_error_not_a_wrong_id():
    wire = step_to_wire(_decode_step(["a"], [[1]], np.array([[1, 1]], np.int32), np.zeros((1, 2), np.float32)), IdTable())
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
