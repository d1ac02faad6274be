"""The one meaning of "equal within tolerance" (`replay.diff.rules.compare_rows`): under a tolerance two rows are
equal when every logprob both hold is within it, so a rank or top-k order that moved among values within the
tolerance is a near-tie, counted and never a divergence; bitwise, any moved rank or order is a difference, named as
such. These are the cases a real vocabulary (151,936 ids) produces: a seeded draw at rank 100,123 whose neighbour
sits within 1e-6 of it, and a tie in the logits that a kernel orders another way."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from replay.cli.render_replay import render_divergence
from replay.contracts import Array, LogprobsLists, ModelRunnerOutput
from replay.diff import Tolerance, compare_step
from replay.diff.rules import Row, compare_rows

TOL = Tolerance(atol=1e-4)


def _row(ids: list[int], values: list[float], rank: int) -> Row:
    return Row(np.array(ids, np.int32), np.array(values, np.float32), rank)


def test_a_rank_that_moves_among_equal_logprobs_is_a_near_tie_under_a_tolerance_and_a_difference_bitwise():
    a = _row([9, 1, 2, 3], [-12.0, -0.5, -1.0, -2.0], 100_123)
    b = _row([9, 1, 2, 3], [-12.000001, -0.5, -1.0, -2.0], 100_122)
    tolerant = compare_rows(a, b, TOL)
    assert tolerant.equal and tolerant.near_tie and tolerant.rank_changed and not tolerant.topk_changed
    assert 0 < tolerant.max_abs < 1e-5
    bitwise = compare_rows(a, b, Tolerance())
    assert not bitwise.equal and not bitwise.near_tie


def test_a_top_k_reordered_within_the_tolerance_is_a_near_tie_and_beyond_it_a_divergence():
    a = _row([1, 1, 2, 3], [-0.5, -0.5, -1.0, -1.00001], 1)
    b = _row([1, 1, 3, 2], [-0.5, -0.5, -1.000005, -1.000008], 1)  # 2 and 3 swapped, every value within 1e-4
    assert compare_rows(a, b, TOL).near_tie
    far = _row([1, 1, 3, 2], [-0.5, -0.5, -0.9, -1.0], 1)  # 3 moved by 0.1 to overtake 2
    r = compare_rows(a, far, TOL)
    assert not r.equal and r.topk_changed and abs(r.max_abs - 0.10001) < 1e-6


def test_a_token_only_one_side_lists_is_compared_through_the_other_sides_cut_off():
    a = _row([1, 1, 2, 7], [-0.5, -0.5, -1.0, -3.0], 1)
    near = _row([1, 1, 2, 8], [-0.5, -0.5, -1.0, -3.00002], 1)  # 7 and 8 tie at the cut-off
    assert compare_rows(a, near, TOL).near_tie
    far = _row([1, 1, 2, 8], [-0.5, -0.5, -1.0, -2.0], 1)  # the third best moved by a whole nat
    r = compare_rows(a, far, TOL)
    assert not r.equal and r.max_abs == 1.0


def test_the_sampled_logprob_beyond_the_tolerance_is_a_divergence_and_nan_or_equal_infinities_are_not():
    a = _row([4, 1, 2], [-2.0, -0.5, -1.0], 3)
    assert not compare_rows(a, _row([4, 1, 2], [-2.001, -0.5, -1.0], 3), TOL).equal
    special = _row([4, 1, 2], [float("-inf"), float("nan"), -1.0], 3)
    for tol in (TOL, Tolerance()):
        r = compare_rows(special, _row([4, 1, 2], [float("-inf"), float("nan"), -1.0], 3), tol)
        assert r.equal and r.max_abs == 0.0
    assert not compare_rows(special, _row([4, 1, 2], [-50.0, float("nan"), -1.0], 3), TOL).equal


def _out(rank: int, sampled: float) -> ModelRunnerOutput:
    lp = LogprobsLists(Array.from_numpy(np.array([[5, 1, 2]], np.int32)),
                       Array.from_numpy(np.array([[sampled, -0.1, -2.0]], np.float32)),
                       Array.from_numpy(np.array([rank], np.int64)), [0, 1])
    return ModelRunnerOutput(["r"], {"r": 0}, [[5]], lp)


def test_a_step_whose_only_change_is_a_rank_matches_within_atol_and_is_named_bitwise():
    expected, actual = _out(649, -7.0), _out(648, -7.0)
    summary, divs = compare_step(17, expected, actual, {"r": "cmpl-1"}, {}, TOL)
    assert divs == [] and summary.near_ties == 1 and summary.logprob_mismatches == 0
    summary, divs = compare_step(17, expected, actual, {"r": "cmpl-1"}, {}, Tolerance())
    (d,) = divs
    assert d.kind == "logprobs" and summary.near_ties == 0
    (line,) = render_divergence(d)
    assert line.endswith("same token 5, rank 649 -> 648, logprobs equal"), line


def test_no_divergence_line_prints_numbers_within_the_tolerance_it_was_judged_by():
    rng = np.random.default_rng(40)
    print("seed 40")
    for _ in range(300):
        k = 4
        ids = rng.choice(151_936, size=k, replace=False).astype(np.int32)
        vals = np.sort(rng.normal(-5, 2, size=k).astype(np.float32))[::-1]
        a = Row(np.concatenate([ids[:1], ids]), np.concatenate([vals[:1], vals]), int(rng.integers(1, 5)))
        noise = rng.choice([0.0, 2e-5, 5e-5, 2e-4, 1e-2], size=k + 1).astype(np.float32)
        bvals = a.values + noise * rng.choice([-1, 1], size=k + 1)
        order = np.argsort(-bvals[1:], kind="stable")
        b = Row(np.concatenate([ids[:1], ids[order]]), np.concatenate([bvals[:1], bvals[1:][order]]),
                a.rank + int(rng.integers(-1, 2)))
        r = compare_rows(a, b, TOL)
        # equal exactly when the number a verdict prints (max |Δlogprob|) is within the tolerance it states
        assert r.equal == (r.max_abs <= TOL.atol), (r, a, b)


def _flip(token: int, sampled: float) -> ModelRunnerOutput:
    """A random request's output: the sampled token at rank 300 of a flat distribution, top-2 the same on both."""
    lp = LogprobsLists(Array.from_numpy(np.array([[token, 1, 2]], np.int32)),
                       Array.from_numpy(np.array([[sampled, -0.1, -2.0]], np.float32)),
                       Array.from_numpy(np.array([300], np.int64)), [0, 1])
    return ModelRunnerOutput(["r"], {"r": 0}, [[token]], lp)


def test_a_random_draw_that_differs_over_the_same_logprobs_is_another_draw_never_a_tie_or_confident_flip():
    expected, actual = _flip(737, -11.0), _flip(187, -9.5)  # another token drawn; the top-2 equal to the bit
    _, (d,) = compare_step(0, expected, actual, {"r": "cmpl-6"}, {}, TOL, random_draws={"r"})
    assert d.kind == "token" and d.flip == "draw" and d.same_distribution
    assert d.max_abs_logprob_diff == 0  # what both sides hold is equal: two tokens' logprobs are not a difference
    assert "(RANDOM DRAW)" in render_divergence(d)[0] and "same distribution, another draw" in render_divergence(d)[1]
    _, (g,) = compare_step(0, expected, actual, {"r": "cmpl-6"}, {}, TOL)  # a greedy request: the margin decides
    assert g.flip in ("tie", "confident") and not g.same_distribution
    moved = _flip(187, -9.5)
    lp = LogprobsLists(moved.logprobs.logprob_token_ids, Array.from_numpy(np.array([[-9.5, -0.3, -2.0]], np.float32)),
                       moved.logprobs.sampled_token_ranks, [0, 1])
    _, (m,) = compare_step(0, expected, ModelRunnerOutput(["r"], {"r": 0}, [[187]], lp), {"r": "cmpl-6"}, {}, TOL,
                           random_draws={"r"})
    assert m.flip == "draw" and not m.same_distribution  # the distribution moved too: not the sampler alone


def test_a_random_draw_of_another_token_from_the_same_rows_is_the_same_distribution():
    from replay.diff.rules import same_distribution

    tol = Tolerance()
    recorded = _row([713, 5, 713, 9], [-4.1, -0.5, -4.1, -1.2], 60)  # column 0: the sampled token
    replayed = _row([22, 5, 713, 9], [-7.3, -0.5, -4.1, -1.2], 849)  # another draw, the same top-k
    d = compare_rows(recorded, replayed, tol)
    assert not d.equal and same_distribution(d)  # the rows differ as draws do, not as distributions
    moved = _row([22, 5, 713, 9], [-7.3, -0.5, -4.1000004, -1.2], 849)
    assert not same_distribution(compare_rows(recorded, moved, tol))  # a logprob moved by an ulp: bitwise, no
    assert same_distribution(compare_rows(recorded, moved, Tolerance(atol=1e-4)))
    reordered = _row([22, 9, 713, 5], [-7.3, -1.2, -4.1, -0.5], 849)
    assert not same_distribution(compare_rows(recorded, reordered, tol))  # another top-k order


def test_same_distribution_follows_rtol_and_never_takes_a_nan_on_one_side():
    from replay.diff.rules import same_distribution

    recorded = _row([713, 5, 713, 9], [-4.1, -0.5, -4.1, -1.2], 60)
    scaled = _row([22, 5, 713, 9], [-7.3, -0.5001, -4.1004, -1.2001], 849)  # 1e-4 relative, 4e-4 absolute at most
    assert same_distribution(compare_rows(recorded, scaled, Tolerance(rtol=2e-4)))
    assert not same_distribution(compare_rows(recorded, scaled, Tolerance(atol=1e-4)))
    nan = _row([22, 5, 713, 9], [-7.3, float("nan"), -4.1, -1.2], 849)  # one side's top logprob is NaN
    for tol in (Tolerance(), Tolerance(atol=1.0)):
        d = compare_rows(recorded, nan, tol)
        assert d.max_abs == 0.0 and not same_distribution(d)  # max_abs skips the NaN; the rule does not


def _padded(token: int) -> ModelRunnerOutput:
    """A greedy request's output in a step where a neighbour asked `logprob_token_ids`: column 0, then padding."""
    lp = LogprobsLists(Array.from_numpy(np.array([[token, 0, 0]], np.int32)),
                       Array.from_numpy(np.array([[-0.7, -np.inf, -np.inf]], np.float32)),
                       Array.from_numpy(np.array([1], np.int64)))
    return ModelRunnerOutput(["r"], {"r": 0}, [[token]], lp)


def test_padding_has_no_margin_so_a_flip_beside_logprob_token_ids_takes_the_runners_margin_without_a_warning():
    from replay.diff.rules import margin

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's -inf - -inf: "invalid value encountered in scalar subtract"
        assert margin(_row([4, 0, 0], [-0.7, -np.inf, -np.inf], 1)) is None
        assert margin(_row([4, 9, 3], [-0.7, -2.0, -0.5], 1)) is None  # asked ids in the request's order
        assert margin(_row([4, 4, 3], [-0.7, -0.7, -0.9], 1)) == pytest.approx(0.2)  # a top-k row, as before
        _, (tie,) = compare_step(0, _padded(4), _padded(5), {"r": "cmpl-1"}, {}, TOL, actual_margins={"r": 0.01})
        _, (unknown,) = compare_step(0, _padded(4), _padded(5), {"r": "cmpl-1"}, {}, TOL)
    assert tie.flip == "tie" and tie.margin == 0.01
    assert unknown.flip == "confident" and unknown.margin is None  # two paddings are no evidence of a near-tie


def _greedy(token: int, ids: list[int], values: list[float], rank: int) -> ModelRunnerOutput:
    lp = LogprobsLists(Array.from_numpy(np.array([[token, *ids]], np.int32)),
                       Array.from_numpy(np.array([[values[0], *values[1:]]], np.float32)),
                       Array.from_numpy(np.array([rank], np.int64)))
    return ModelRunnerOutput(["r"], {"r": 0}, [[token]], lp)


def test_a_greedy_token_tied_with_another_is_its_argmax_though_vllm_ranks_it_2():
    """vLLM ranks a token among those scored at least as high: an exact tie (real vocabularies) is rank 2, and a
    greedy flip between the two tied tokens is a tie flip, never a sampler that missed its argmax."""
    from replay.diff.rules import below_argmax

    assert not below_argmax(_row([7, 7, 9], [-0.5, -0.5, -0.9], 2))  # tied with token 9 at the top
    assert below_argmax(_row([7, 9, 7], [-0.9, -0.5, -0.9], 3))  # token 9 scored higher
    assert not below_argmax(_row([7], [-0.9], 2))  # no column to tell: a tie or a miss alike, not claimed
    assert below_argmax(_row([7], [-0.9], 3))  # (two others tied exactly with it: not a tie flip)
    # a batch beside a `logprob_token_ids` request: the asked ids in the request's order, -inf in other rows
    assert not below_argmax(_row([7, 0, 0], [-0.5, -np.inf, -np.inf], 2))  # padding says nothing
    assert below_argmax(_row([7, 3], [-2.0, -4.0], 5))  # the asked id scored lower; rank 5 is a miss
    assert below_argmax(_row([7, 3, 5], [-2.0, -4.0, -1.0], 2))  # an asked id scored higher
    tied_a, tied_b = _greedy(7, [7, 9], [-0.5, -0.5, -0.5], 2), _greedy(9, [9, 7], [-0.5, -0.5, -0.5], 2)
    _, (d,) = compare_step(0, tied_a, tied_b, {"r": "cmpl-1"}, {}, TOL, greedy={"r"})
    assert d.kind == "token" and d.flip == "tie", d
    below = _greedy(7, [9, 7], [-0.9, -0.5, -0.9], 2)
    _, (d,) = compare_step(0, below, tied_b, {"r": "cmpl-1"}, {}, TOL, greedy={"r"})
    assert d.flip == "not-argmax", d


def test_a_row_widened_by_its_batch_is_compared_over_the_columns_both_rows_hold():
    """vLLM returns as many top-k columns as the batch's largest `logprobs`: a logprobs=5 request beside a
    logprobs=20 one gets 20, alone 5. The columns only the wider row has are no change, bitwise or not."""
    ids, vals = list(range(100, 121)), [-10.0 - 0.01 * i for i in range(21)]
    alone, beside = _row([7] + ids[:5], [-11.8] + vals[:5], 28_371), _row([7] + ids, [-11.8] + vals, 28_371)
    for tol in (Tolerance(), TOL):
        d = compare_rows(beside, alone, tol)
        assert d.equal and not d.topk_changed and not d.near_tie, (tol, d)
    moved = _row([7] + ids[:4] + [999], [-11.8] + vals[:5], 28_371)  # within the 5 both hold: a change
    assert compare_rows(beside, moved, Tolerance()).topk_changed
