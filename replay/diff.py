"""Compare model-runner outputs: tokens exactly, logprobs within a tolerance, flips classified by margin.

A token flip at a near-tie (the top1-top2 margin below `tie_margin`) is a *tie flip*: numerics noise made visible.
A flip at a large margin is a *confident flip*: something is wrong (wrong KV block, wrong position, a bug).
"Near" means below `tie_margin`, or within twice the logprob noise measured at the same position.
Tolerances default to bitwise (`atol = rtol = 0`); vLLM's own tests compare scheduling modes with rtol 1e-3 and
atol 1e-6.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from replay.contracts import LogprobsLists, ModelRunnerOutput, SchedulerOutput

DEFAULT_TIE_MARGIN = 0.05  # nats: a flip whose top1-top2 margin is below this is a tie flip


class Tolerance(msgspec.Struct, frozen=True):
    """When two logprobs count as equal: |a - b| <= atol + rtol * |b| (both 0: the same bits)."""

    atol: float = 0.0
    rtol: float = 0.0
    tie_margin: float = DEFAULT_TIE_MARGIN

    @property
    def bitwise(self) -> bool:
        """True when nothing but identical bits is equal."""
        return self.atol == 0 and self.rtol == 0

    def equal(self, a: np.ndarray, b: np.ndarray) -> bool:
        """Arrays equal within the tolerance (NaN equals NaN)."""
        if a.shape != b.shape:
            return False
        if self.bitwise:
            return a.tobytes() == b.tobytes()
        return bool(np.allclose(a, b, rtol=self.rtol, atol=self.atol, equal_nan=True))


class BatchComposition(msgspec.Struct):
    """What else ran in a step: the batch-variance suspect list."""

    step: int
    num_requests: int
    num_tokens: int
    num_prefill: int  # requests scheduling more than one token, or new
    num_decode: int
    request_ids: list[str]  # external ids of every scheduled request
    num_scheduled_tokens: dict[str, int]  # external id -> tokens this step


class Divergence(msgspec.Struct, omit_defaults=True):
    """One request at one output position where expected and actual part."""

    step: int
    request_id: str  # external id
    position: int  # index of the output token within the request (0 = first generated token)
    kind: str  # "token" | "logprobs" | "prompt_logprobs" | "missing"
    expected_token: int | None = None
    actual_token: int | None = None
    expected_rank: int | None = None
    actual_rank: int | None = None
    max_abs_logprob_diff: float = 0.0  # over the tokens both top-k lists contain (and the sampled token)
    sampled_logprob_diff: float | None = None
    margin: float | None = None  # top1 - top2 raw logprob where the flip happened
    flip: str | None = None  # "tie" | "confident" for a token flip
    topk_changed: bool = False
    internal_id: str = ""


class StepSummary(msgspec.Struct):
    """Per-step numbers for the summary table."""

    step: int
    num_requests: int
    num_tokens: int
    token_mismatches: int = 0
    logprob_mismatches: int = 0
    max_abs_logprob_diff: float = 0.0
    topk_set_changes: int = 0
    rank_changes: int = 0
    foreign_draws_differ: int = 0  # sampled tokens another implementation drew with its own RNG (not compared)


def batch_composition(step: int, so: SchedulerOutput, ext: dict[str, str]) -> BatchComposition:
    """The batch a step ran, with external ids."""
    new = {r.req_id for r in so.scheduled_new_reqs}
    prefill = sum(1 for rid, n in so.num_scheduled_tokens.items() if rid in new or n > 1)
    ids = [ext.get(r, r) for r in so.num_scheduled_tokens]
    return BatchComposition(step, len(ids), so.total_num_scheduled_tokens, prefill, len(ids) - prefill, ids,
                            {ext.get(r, r): n for r, n in so.num_scheduled_tokens.items()})


def _row(lp: LogprobsLists | None, i: int):
    if lp is None or i >= lp.num_rows:
        return None
    return (lp.logprob_token_ids.to_numpy()[i], lp.logprobs.to_numpy()[i], int(lp.sampled_token_ranks.to_numpy()[i]))


def _margin(row) -> float | None:
    if row is None or len(row[1]) < 3:
        return None
    return float(row[1][1] - row[1][2])


def classify(margin: float | None, tol: Tolerance, noise: float = 0.0) -> str:
    """tie | confident. A flip is a tie flip when its top1-top2 margin is below `tol.tie_margin`, or within twice
    the logprob noise measured at that very position (`noise` = max |Δlogprob| there): the numerics moved the
    logprobs by as much as it took to swap the top two. An unknown margin counts as confident."""
    if margin is None:
        return "confident"
    return "tie" if margin < tol.tie_margin or margin <= 2 * noise else "confident"


def _lp_diff(er, ar) -> tuple[float, bool]:
    """(max |Δlogprob| over tokens present in both rows, whether the top-k id list changed)."""
    eids, evals, _ = er
    aids, avals, _ = ar
    common = {}
    for t, v in zip(aids.tolist(), avals.tolist()):
        common.setdefault(t, v)
    diffs = [abs(v - common[t]) for t, v in zip(eids.tolist(), evals.tolist()) if t in common]
    finite = [d for d in diffs if not math.isnan(d)]
    return (max(finite) if finite else 0.0), eids[1:].tolist() != aids[1:].tolist()


def compare_step(step: int, expected: ModelRunnerOutput | None, actual: ModelRunnerOutput | None,
                 ext: dict[str, str], positions: dict[str, int], tol: Tolerance,
                 actual_margins: dict[str, float] | None = None, num_tokens: int = 0,
                 foreign_draws: set[str] | frozenset = frozenset()) -> tuple[StepSummary, list[Divergence]]:
    """Diff one step's outputs. `positions[rid]` = output tokens the request had before this step. Requests in
    `foreign_draws` were sampled with random streams this runner cannot repeat: their sampled token (and its
    logprob column and rank) is counted when it differs, not compared; their top-k logprobs are."""
    exp_ids = expected.req_ids if expected is not None else []
    summary = StepSummary(step, len(exp_ids), num_tokens)
    divs: list[Divergence] = []
    for i, rid in enumerate(exp_ids):
        name = ext.get(rid, rid)
        pos = positions.get(rid, 0)
        j = actual.req_id_to_index.get(rid) if actual is not None else None
        if j is None:
            divs.append(Divergence(step, name, pos, "missing", internal_id=rid))
            summary.token_mismatches += 1
            continue
        et, at = expected.sampled_token_ids[i], actual.sampled_token_ids[j]
        er, ar = _row(expected.logprobs, i), _row(actual.logprobs, j)
        if rid in foreign_draws:
            if et != at:
                summary.foreign_draws_differ += 1
                at = et
            if er is not None and ar is not None:  # column 0 is the draw's own logprob: take it as recorded
                ar = (np.concatenate([er[0][:1], ar[0][1:]]), np.concatenate([er[1][:1], ar[1][1:]]), er[2])
        lp_diff, topk_changed, lp_equal = 0.0, False, True
        if er is not None and ar is not None:
            lp_diff, topk_changed = _lp_diff(er, ar)
            lp_equal = (tol.equal(er[1], ar[1]) and er[0].tobytes() == ar[0].tobytes() and er[2] == ar[2])
            summary.topk_set_changes += topk_changed
            summary.rank_changes += er[2] != ar[2]
        elif (er is None) != (ar is None):
            lp_equal = False
        summary.max_abs_logprob_diff = max(summary.max_abs_logprob_diff, lp_diff)
        sampled_diff = float(ar[1][0] - er[1][0]) if er is not None and ar is not None and et == at else None
        if et != at:
            summary.token_mismatches += 1
            margin = _margin(er)
            if margin is None and actual_margins is not None:
                margin = actual_margins.get(rid)
            divs.append(Divergence(step, name, pos, "token", et[0] if et else None, at[0] if at else None,
                                   er[2] if er else None, ar[2] if ar else None, lp_diff, None, margin,
                                   classify(margin, tol, lp_diff), topk_changed, rid))
        elif not lp_equal:
            summary.logprob_mismatches += 1
            divs.append(Divergence(step, name, pos, "logprobs", et[0] if et else None, at[0] if at else None,
                                   er[2] if er else None, ar[2] if ar else None, lp_diff, sampled_diff,
                                   _margin(er), None, topk_changed, rid))
        ep, ap = expected.prompt_logprobs_dict.get(rid), actual.prompt_logprobs_dict.get(rid)
        if (ep is None) != (ap is None) or (ep is not None and not (
                tol.equal(ep.logprobs.to_numpy(), ap.logprobs.to_numpy())
                and ep.logprob_token_ids.to_numpy().tobytes() == ap.logprob_token_ids.to_numpy().tobytes())):
            summary.logprob_mismatches += 1
            d = 0.0
            if ep is not None and ap is not None and ep.logprobs.shape == ap.logprobs.shape:
                d = float(np.nanmax(np.abs(ep.logprobs.to_numpy() - ap.logprobs.to_numpy()), initial=0.0))
            divs.append(Divergence(step, name, 0, "prompt_logprobs", max_abs_logprob_diff=d, internal_id=rid))
    return summary, divs
