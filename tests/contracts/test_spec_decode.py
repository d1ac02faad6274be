"""Speculative decoding in the step contracts: drafts and their acceptance, rows per request, prefill counts, and
a step with requests taken out (what a `--force` replay leaves out)."""

from __future__ import annotations

import numpy as np

from replay.contracts import (
    Array,
    CachedRequestData,
    GrammarOutput,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    accepted_drafts,
    draft_counts,
)


def _step() -> SchedulerOutput:
    new = NewRequestData("n", [1, 2, 3], [], SamplingParams(), None, ([4],), 0, None)
    cached = CachedRequestData(["a", "b"], {"b"}, [], {"b": [9, 9]}, [None, ([7],)], [10, 20], [2, 3])
    return SchedulerOutput([new], cached, {"n": 3, "a": 4, "b": 1}, 8, {"a": [5, 6, 7]}, {}, {"gone", "b2"}, [])


def test_drafts_accepted_are_the_emitted_tokens_but_the_last():
    assert accepted_drafts([5, 6, 7], [5, 6, 1]) == 2
    assert accepted_drafts([5, 6, 7], [5, 6, 7, 8]) == 3 and accepted_drafts([5], []) == 0
    mro = ModelRunnerOutput(["n", "a", "b"], {"n": 0, "a": 1, "b": 2}, [[1], [5, 2], [3]])
    counts = draft_counts(_step(), mro)
    assert (counts.drafted, counts.accepted, counts.verifying_requests) == (3, 1, 1)
    assert abs(counts.acceptance_rate - 1 / 3) < 1e-9


def test_a_decode_verifying_drafts_is_not_a_prefill():
    assert _step().num_prefill_requests() == 1  # "n" only: "a" schedules 1 token + 3 drafts


def test_rows_of_follow_cu_num_generated_tokens():
    lp = LogprobsLists(Array.from_numpy(np.zeros((5, 2), np.int32)), Array.from_numpy(np.zeros((5, 2), np.float32)),
                       Array.from_numpy(np.zeros(5, np.int64)), [0, 1, 4, 5])
    assert [list(lp.rows_of(i)) for i in range(3)] == [[0], [1, 2, 3], [4]] and lp.first_row(2) == 4
    plain = LogprobsLists(lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks)
    assert list(plain.rows_of(3)) == [3] and list(plain.rows_of(7)) == []


def test_a_step_without_some_requests():
    so = _step().without({"a", "gone"})
    assert [n.req_id for n in so.scheduled_new_reqs] == ["n"] and so.scheduled_cached_reqs.req_ids == ["b"]
    assert so.scheduled_cached_reqs.num_computed_tokens == [20] and so.scheduled_cached_reqs.new_block_ids == [([7],)]
    assert so.num_scheduled_tokens == {"n": 3, "b": 1} and so.total_num_scheduled_tokens == 4
    assert so.scheduled_spec_decode_tokens == {} and so.finished_req_ids == {"b2"}
    assert _step().without(set()) == _step() and _step().without({"zzz"}) == _step()


def test_grammar_rows_without_a_request_drop_one_row_per_position():
    masks = np.arange(5 * 2, dtype=np.int32).reshape(5, 2)  # "a": 1 + 2 drafts rows, then "c", then "d"
    go = GrammarOutput(["a", "c", "d"], Array.from_numpy(masks))
    kept = go.without({"a"}, {"a": [1, 2]})
    assert kept.structured_output_request_ids == ["c", "d"]
    assert kept.grammar_bitmask.to_numpy().tolist() == masks[3:].tolist()
    assert go.without({"a", "c", "d"}, {"a": [1, 2]}) is None and go.without({"x"}, {}) is go
