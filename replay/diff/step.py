"""`compare_step`: one replayed step against its recording (`replay run --diff`), request by request: tokens
exactly, logprobs by the rules of `replay.diff.rules`."""

from __future__ import annotations

import msgspec
import numpy as np

from replay.contracts import ModelRunnerOutput, SchedulerOutput
from replay.diff.rules import (
    Row,
    Tolerance,
    classify,
    logprob_diff,
    margin,
    row,
    rows_equal,
)


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
    tokens_compared: int = 0  # sampled tokens (output positions) of this step that were compared


def batch_composition(step: int, so: SchedulerOutput, ext: dict[str, str]) -> BatchComposition:
    """The batch a step ran, with external ids."""
    new = {r.req_id for r in so.scheduled_new_reqs}
    prefill = sum(1 for rid, n in so.num_scheduled_tokens.items() if rid in new or n > 1)
    ids = [ext.get(r, r) for r in so.num_scheduled_tokens]
    return BatchComposition(step, len(ids), so.total_num_scheduled_tokens, prefill, len(ids) - prefill, ids,
                            {ext.get(r, r): n for r, n in so.num_scheduled_tokens.items()})


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
        er, ar = row(expected.logprobs, i), row(actual.logprobs, j)
        summary.tokens_compared += len(et)
        if rid in foreign_draws:
            if et != at:
                summary.foreign_draws_differ += 1
                at = et
            if er is not None and ar is not None:  # column 0 is the draw's own logprob: take it as recorded
                ar = Row(np.concatenate([er.ids[:1], ar.ids[1:]]), np.concatenate([er.values[:1], ar.values[1:]]),
                         er.rank)
        lp_diff, topk_changed, lp_equal = 0.0, False, True
        if er is not None and ar is not None:
            lp_diff, topk_changed = logprob_diff(er, ar)
            lp_equal = rows_equal(er, ar, tol)
            summary.topk_set_changes += topk_changed
            summary.rank_changes += er.rank != ar.rank
        elif (er is None) != (ar is None):
            lp_equal = False
        summary.max_abs_logprob_diff = max(summary.max_abs_logprob_diff, lp_diff)
        sampled_diff = float(ar.values[0] - er.values[0]) if er is not None and ar is not None and et == at else None
        if et != at:
            summary.token_mismatches += 1
            m = margin(er)
            if m is None and actual_margins is not None:
                m = actual_margins.get(rid)
            divs.append(Divergence(step, name, pos, "token", et[0] if et else None, at[0] if at else None,
                                   er.rank if er else None, ar.rank if ar else None, lp_diff, None, m,
                                   classify(m, tol, lp_diff), topk_changed, rid))
        elif not lp_equal:
            summary.logprob_mismatches += 1
            divs.append(Divergence(step, name, pos, "logprobs", et[0] if et else None, at[0] if at else None,
                                   er.rank if er else None, ar.rank if ar else None, lp_diff, sampled_diff,
                                   margin(er), None, topk_changed, rid))
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
