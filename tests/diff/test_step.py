"""`compare_step` on steps where a request emits several tokens (speculative decoding): tokens compared position by
position with their own logprob rows (located by `cu_num_generated_tokens`), equal tokens never called a flip, and
another number of accepted drafts reported where the two sides part, with the draft that was rejected."""

from __future__ import annotations

import numpy as np

from replay.contracts import Array, LogprobsLists, ModelRunnerOutput
from replay.diff import Tolerance, compare_step


def _out(tokens: dict[str, list[int]], shift: dict[tuple[str, int], float] | None = None) -> ModelRunnerOutput:
    """An output whose row for (request, k) has logprobs [-1 - k, -2 - k, -3 - k] (+ `shift` there), sampled first."""
    ids, vals, cu = [], [], [0]
    for rid, toks in tokens.items():
        for k, t in enumerate(toks):
            ids.append([t, t, t + 1])
            vals.append([-1.0 - k + (shift or {}).get((rid, k), 0.0), -1.0 - k, -2.5 - k])
        cu.append(cu[-1] + len(toks))
    lp = LogprobsLists(Array.from_numpy(np.array(ids, np.int32)), Array.from_numpy(np.array(vals, np.float32)),
                       Array.from_numpy(np.ones(len(ids), np.int64)), cu)
    rids = list(tokens)
    return ModelRunnerOutput(rids, {r: i for i, r in enumerate(rids)}, [tokens[r] for r in rids], lp)


def test_equal_multi_token_steps_match_and_count_every_token():
    out = _out({"a": [5], "b": [7, 8, 9]})
    summary, divs = compare_step(3, out, _out({"a": [5], "b": [7, 8, 9]}), {}, {"b": 10}, Tolerance(),
                                 drafts={"b": [8, 9]})
    assert divs == [] and summary.tokens_compared == 4 and summary.token_mismatches == 0


def test_a_logprob_difference_is_reported_at_its_own_position_with_its_own_row():
    expected = _out({"a": [5], "b": [7, 8, 9]})
    actual = _out({"a": [5], "b": [7, 8, 9]}, shift={("b", 2): 1e-3})
    summary, divs = compare_step(3, expected, actual, {}, {"b": 10}, Tolerance())
    assert [(d.request_id, d.position, d.kind, d.expected_token) for d in divs] == [("b", 12, "logprobs", 9)]
    assert abs(divs[0].max_abs_logprob_diff - 1e-3) < 1e-6 and summary.token_mismatches == 0


def test_a_flip_inside_a_multi_token_step_is_at_its_position_and_names_the_acceptance():
    expected = _out({"b": [7, 8, 9, 4]})  # 3 drafts accepted + bonus
    actual = _out({"b": [7, 6]})  # draft 1 rejected: the replay's own token 6 there
    summary, divs = compare_step(3, expected, actual, {}, {"b": 10}, Tolerance(), drafts={"b": [8, 9, 4]})
    (d,) = divs
    assert (d.position, d.kind, d.expected_token, d.actual_token) == (11, "token", 8, 6)
    assert (d.num_drafts, d.expected_accepted, d.actual_accepted) == (3, 3, 1)
    assert (d.rejected_draft, d.rejected_position) == (9, 11)
    assert summary.token_mismatches == 1 and summary.draft_mismatches == 0


def test_fewer_tokens_with_equal_common_tokens_is_a_draft_difference_not_a_flip():
    expected = _out({"b": [7, 8, 9, 4]})
    actual = _out({"b": [7, 8]})  # the replay verified another draft at position 1 and emitted the same token
    summary, divs = compare_step(8, expected, actual, {"b": "req-b"}, {"b": 9}, Tolerance(), drafts={"b": [7, 99, 4]})
    (d,) = divs
    assert (d.step, d.request_id, d.position, d.kind, d.expected_token, d.actual_token) == (8, "req-b", 11, "drafts",
                                                                                            9, None)
    assert d.flip is None and summary.token_mismatches == 0 and summary.draft_mismatches == 1
    assert (d.expected_accepted, d.actual_accepted, d.rejected_draft, d.rejected_position) == (3, 1, 99, 10)


def test_a_partial_prefill_row_is_compared_though_nothing_was_emitted():
    """vLLM keeps a logprob row for the token it discards at the end of a partial prefill chunk."""
    def out(shift):
        lp = LogprobsLists(Array.from_numpy(np.array([[3, 3, 4]], np.int32)),
                           Array.from_numpy(np.array([[-1.0 + shift, -1.0, -2.0]], np.float32)),
                           Array.from_numpy(np.ones(1, np.int64)))
        return ModelRunnerOutput(["a"], {"a": 0}, [[]], lp)
    _, divs = compare_step(0, out(0.0), out(1e-4), {}, {}, Tolerance())
    assert [(d.kind, d.position, d.expected_token) for d in divs] == [("logprobs", 0, None)]
    assert compare_step(0, out(0.0), out(1e-4), {}, {}, Tolerance(atol=1e-3))[1] == []


def test_moe_routing_is_compared_token_by_token_with_the_step_schedule():
    """Rows of `routed_experts` follow the scheduled tokens (requests in batch order): the first token routed
    otherwise is named by its index in its request (computed tokens before the step + its row), with the layer; a
    replay that returns no routing compares none; the same routing is equal whatever the logprobs."""
    from msgspec.structs import replace

    from replay.contracts import CachedRequestData, RoutedExpertsLists, SchedulerOutput

    so = SchedulerOutput([], CachedRequestData(["a", "b"], set(), [], {}, [None, None], [12, 40], [2, 5]),
                         {"a": 1, "b": 3}, 4, {}, {}, set(), [])

    def routed(data):
        data = np.array(data, np.int32)
        return RoutedExpertsLists(Array.from_numpy(data), Array.from_numpy(np.arange(len(data), dtype=np.int64)))

    rows = [[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[2, 3], [0, 1]], [[3, 0], [1, 2]]]  # a: 1 token; b: 3 tokens
    moved = [r for r in rows]
    moved[2] = [[2, 3], [1, 0]]  # b's second token (index 41), layer 1: the order of its top-2 swapped
    out = _out({"a": [5], "b": [7]})
    expected = replace(out, routed_experts=routed(rows))
    summary, divs = compare_step(3, expected, replace(out, routed_experts=routed(rows)), {}, {}, Tolerance(), so=so)
    assert divs == [] and summary.tokens_routed == 4
    summary, (d,) = compare_step(3, expected, replace(out, routed_experts=routed(moved)), {"b": "req-b"}, {},
                                 Tolerance(),
                                 so=so)
    assert (d.kind, d.request_id, d.token_index, d.moe_layer) == ("routed_experts", "req-b", 41, 1)
    assert (d.expected_experts, d.actual_experts, summary.routing_mismatches) == ([0, 1], [1, 0], 1)
    summary, divs = compare_step(3, expected, out, {}, {}, Tolerance(), so=so)  # the replay returned none
    assert divs == [] and summary.tokens_routed == 0


def test_routing_is_compared_only_where_both_sides_routed_and_not_for_rebuilt_requests():
    """Two sides that routed no common token compare nothing (no error); a request rebuilt from a keyframe (held to
    a looser tolerance) is not compared; rows of drafts a request rejected are not its routing."""
    from msgspec.structs import replace

    from replay.contracts import AuxRequestOutput, CachedRequestData, RoutedExpertsLists, SchedulerOutput

    so = SchedulerOutput([], CachedRequestData(["b"], set(), [], {}, [None], [40], [5]), {"b": 3}, 3,
                         {"b": [8, 9]}, {}, set(), [])
    out = _out({"b": [7, 8]})  # one of two drafts accepted, then the bonus token

    def aux(start, n, shape=(2, 2)):
        return {"b": AuxRequestOutput(start, Array.from_numpy(np.zeros((n, *shape), np.uint8)))}

    e = replace(out, aux_output_connector_output=aux(40, 3))
    for a in (replace(out, aux_output_connector_output=aux(50, 2)),  # later tokens only
              replace(out, aux_output_connector_output=aux(50, 2, (3, 2)))):  # and another number of layers
        summary, divs = compare_step(3, e, a, {}, {}, Tolerance(), so=so)
        assert divs == [] and summary.tokens_routed == 0
    moved = replace(out, aux_output_connector_output=aux(40, 3, (2, 3)))
    assert compare_step(3, e, moved, {}, {}, Tolerance(), so=so)[1][0].kind == "routed_experts"
    assert compare_step(3, e, moved, {}, {}, Tolerance(), so=so, tol_of={"b": Tolerance(atol=1e-4)})[1] == []
    data = np.arange(3 * 2 * 2, dtype=np.int32).reshape(3, 2, 2)
    routed = replace(out, routed_experts=RoutedExpertsLists(Array.from_numpy(data)))
    start, rows = routed.routing(so)["b"]
    assert start == 40 and np.array_equal(rows, data[:2])  # the token and the accepted draft, not the rejected one


def _prompt(rows: int, shift: float = 0.0):
    from replay.contracts import LogprobsTensors

    ids = np.arange(rows * 3, dtype=np.int32).reshape(rows, 3)
    vals = -np.arange(1, rows * 3 + 1, dtype=np.float32).reshape(rows, 3) + shift
    return LogprobsTensors(Array.from_numpy(ids), Array.from_numpy(vals), Array.from_numpy(np.ones(rows, np.int32)))


def _tail(t, start: int):
    """Prompt logprobs `t` without their first `start` rows (what our runner computes after a keyframe)."""
    from replay.contracts import LogprobsTensors

    return LogprobsTensors(*(Array.from_numpy(a.to_numpy()[start:]) for a in (t.logprob_token_ids, t.logprobs,
                                                                               t.selected_token_ranks)))


def test_prompt_logprobs_on_one_side_only_name_the_rows_each_side_has():
    import msgspec

    from replay.cli.render_replay import render_divergence

    expected = _out({"a": [5]})
    actual = msgspec.structs.replace(expected, prompt_logprobs_dict={"a": _prompt(4)})
    _, [d] = compare_step(3, expected, actual, {}, {}, Tolerance())
    assert (d.kind, d.expected_rows, d.actual_rows) == ("prompt_logprobs", None, 4)
    assert render_divergence(d) == ["  step 3, request a: its prompt logprobs: none recorded, 4 rows replayed"]


def test_prompt_logprobs_from_a_row_on_compare_the_rows_computed_after_it():
    import msgspec

    full = msgspec.structs.replace(_out({"a": [5]}), prompt_logprobs_dict={"a": _prompt(6)})
    tail = msgspec.structs.replace(_out({"a": [5]}), prompt_logprobs_dict={"a": _tail(_prompt(6), 2)})
    assert compare_step(3, full, tail, {}, {}, Tolerance(), prompt_from={"a": 2})[1] == []  # fewer rows: the tail
    assert compare_step(3, full, full, {}, {}, Tolerance(), prompt_from={"a": 2})[1] == []  # all rows: their tail
    moved = msgspec.structs.replace(_out({"a": [5]}), prompt_logprobs_dict={"a": _prompt(6, shift=1e-3)})
    [d] = compare_step(3, full, moved, {}, {}, Tolerance(), prompt_from={"a": 2})[1]
    assert d.expected_rows is None and abs(d.max_abs_logprob_diff - 1e-3) < 1e-6
