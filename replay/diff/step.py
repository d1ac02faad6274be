"""`compare_step`: one replayed step against its recording (`replay run --diff`), request by request: tokens
exactly, logprobs by the rules of `replay.diff.rules`."""

from __future__ import annotations

import msgspec
import numpy as np

from replay.contracts import LogprobsTensors, ModelRunnerOutput, SchedulerOutput, accepted_drafts
from replay.diff.rules import (
    Row,
    Tolerance,
    below_argmax,
    classify,
    compare_rows,
    margin,
    row,
    same_distribution,
)


class BatchComposition(msgspec.Struct):
    """What else ran in a step: the batch-variance suspect list."""

    step: int
    num_requests: int
    num_tokens: int
    num_prefill: int  # new requests, or scheduling more than one token beyond their drafts
    num_decode: int
    request_ids: list[str]  # external ids of every scheduled request
    num_scheduled_tokens: dict[str, int]  # external id -> tokens this step


class Divergence(msgspec.Struct, omit_defaults=True):
    """One request at one output position where expected and actual part."""

    step: int
    request_id: str  # external id
    position: int  # index of the output token within the request (0 = first generated token)
    # "token" | "drafts" (one side emitted fewer tokens) | "logprobs" | "prompt_logprobs" | "missing" |
    # "routed_experts" (an MoE layer routed one of the request's tokens to other experts)
    kind: str
    expected_token: int | None = None
    actual_token: int | None = None
    expected_rank: int | None = None
    actual_rank: int | None = None
    max_abs_logprob_diff: float = 0.0  # over the tokens both top-k lists contain (and the sampled token)
    sampled_logprob_diff: float | None = None
    margin: float | None = None  # top1 - top2 raw logprob where the flip happened
    # a token flip: "tie" | "confident" | "not-argmax" (a greedy request emitted a token that is not its argmax on
    # one side: the sampler, not the numerics, decided it) | "draw" (a random-sampling request drew another token:
    # a top1-top2 margin says nothing about a random draw)
    flip: str | None = None
    topk_changed: bool = False
    internal_id: str = ""
    # prompt logprobs whose numbers of rows differ: each side's (None: it has none); both None where they agree
    expected_rows: int | None = None
    actual_rows: int | None = None
    # speculative decoding: how many of the step's scheduled drafts each side accepted (None: no drafts)
    num_drafts: int | None = None
    expected_accepted: int | None = None
    actual_accepted: int | None = None
    # the draft the side that accepted fewer rejected first, and its output position
    rejected_draft: int | None = None
    rejected_position: int | None = None
    # a "draw" flip whose logprobs are equal within the tolerance: the same distribution, another draw (the sampler)
    same_distribution: bool = False
    # "routed_experts": the request's first token routed otherwise (its index among the request's tokens, prompt
    # first), the first MoE layer (0 = the model's first with experts) and each side's experts there, router order
    token_index: int | None = None
    moe_layer: int | None = None
    expected_experts: list[int] | None = None
    actual_experts: list[int] | None = None


class StepSummary(msgspec.Struct):
    """Per-step numbers for the summary table."""

    step: int
    num_requests: int
    num_tokens: int
    token_mismatches: int = 0
    draft_mismatches: int = 0  # requests that emitted another number of tokens, their common tokens equal
    logprob_mismatches: int = 0
    max_abs_logprob_diff: float = 0.0
    topk_set_changes: int = 0
    rank_changes: int = 0
    foreign_draws_differ: int = 0  # sampled tokens another implementation drew with its own RNG (not compared)
    tokens_compared: int = 0  # sampled tokens (output positions) of this step that were compared
    # logprob rows compared besides the sampled tokens': a partial prefill's discarded token, prompt logprobs
    rows_compared: int = 0
    routing_mismatches: int = 0  # requests with a token whose MoE routing differs
    tokens_routed: int = 0  # scheduled tokens whose MoE routing was compared
    routing_not_compared: bool = False  # the recording kept MoE routing this step and the replay returned none
    # positions whose rank or top-k order moved while every logprob stayed within the tolerance (not divergences)
    near_ties: int = 0


def batch_composition(step: int, so: SchedulerOutput, ext: dict[str, str]) -> BatchComposition:
    """The batch a step ran, with external ids."""
    prefill = so.num_prefill_requests()
    ids = [ext.get(r, r) for r in so.num_scheduled_tokens]
    return BatchComposition(step, len(ids), so.total_num_scheduled_tokens, prefill, len(ids) - prefill, ids,
                            {ext.get(r, r): n for r, n in so.num_scheduled_tokens.items()})


def compare_step(step: int, expected: ModelRunnerOutput | None, actual: ModelRunnerOutput | None,
                 ext: dict[str, str], positions: dict[str, int], tol: Tolerance,
                 actual_margins: dict[str, float] | None = None, num_tokens: int = 0,
                 foreign_draws: set[str] | frozenset = frozenset(),
                 drafts: dict[str, list[int]] | None = None,
                 skip: set[str] | frozenset = frozenset(),
                 greedy: set[str] | frozenset = frozenset(),
                 random_draws: set[str] | frozenset = frozenset(),
                 tol_of: dict[str, Tolerance] | None = None,
                 so: SchedulerOutput | None = None,
                 prompt_from: dict[str, int] | None = None) -> tuple[StepSummary, list[Divergence]]:
    """Diff one step's outputs (`drafts`: the draft tokens the step scheduled per request, if any; `skip`: requests
    the replay left out, not compared; `greedy`: greedy requests, whose tokens must be their argmax; `random_draws`:
    random-sampling requests whose draws are compared, whose flips are draws; `tol_of`: requests compared within
    another tolerance than `tol`, such as those a replay from a keyframe rebuilt). `positions[rid]` = output tokens
    the request had before this step. A request may emit several tokens in one step (speculative decoding: accepted
    drafts plus the bonus token); they are compared position by position, each with its own logprob row, and the
    first position that differs is the one reported.
    Requests in `foreign_draws` were sampled with random streams this runner cannot repeat: their sampled token
    (and its logprob column and rank) is counted when it differs, not compared; their top-k logprobs are.
    `prompt_from[rid]`: the prompt logprob rows before it were computed before the replay started (a request
    rebuilt from a keyframe in the middle of its prompt), so only the rows after it are compared.
    With the step's SchedulerOutput `so`, an MoE model's routing (`ModelRunnerOutput.routing`, where both sides
    have it) is compared token by token, exactly: expert ids are not numerics."""
    exp_ids = expected.req_ids if expected is not None else []
    summary = StepSummary(step, len(exp_ids), num_tokens)
    divs: list[Divergence] = []
    for i, rid in enumerate(exp_ids):
        if rid in skip:
            continue
        name = ext.get(rid, rid)
        pos = positions.get(rid, 0)
        t = tol_of.get(rid, tol) if tol_of else tol
        j = actual.req_id_to_index.get(rid) if actual is not None else None
        if j is None:
            divs.append(Divergence(step, name, pos, "missing", internal_id=rid))
            summary.token_mismatches += 1
            continue
        et, at = expected.sampled_token_ids[i], actual.sampled_token_ids[j]
        summary.tokens_compared += len(et)
        div = _compare_request(step, name, rid, pos, et, at, _rows(expected, i), _rows(actual, j),
                               rid in foreign_draws, t, summary, actual_margins, rid in greedy, rid in random_draws)
        if div is not None:
            d = (drafts or {}).get(rid)
            if d:
                div.num_drafts, div.expected_accepted, div.actual_accepted = \
                    len(d), accepted_drafts(d, et), accepted_drafts(d, at)
                fewer = min(div.expected_accepted, div.actual_accepted)
                if div.expected_accepted != div.actual_accepted and fewer < len(d):
                    div.rejected_draft, div.rejected_position = d[fewer], pos + fewer
            divs.append(div)
        ep, ap = expected.prompt_logprobs_dict.get(rid), actual.prompt_logprobs_dict.get(rid)
        if ep is not None or ap is not None:
            summary.rows_compared += 1
            start = prompt_from.get(rid, 0) if prompt_from else 0
            equal, d, rows = _prompt_logprobs_equal(ep, ap, t, summary, start)
            if not equal:
                summary.logprob_mismatches += 1
                e_rows, a_rows = rows if rows[0] != rows[1] else (None, None)
                divs.append(Divergence(step, name, 0, "prompt_logprobs", max_abs_logprob_diff=d, internal_id=rid,
                                       expected_rows=e_rows, actual_rows=a_rows))
    if so is not None and expected is not None:
        divs += _compare_routing(step, expected, actual, so, ext, positions, skip, summary, tol_of or frozenset())
    return summary, divs


def _compare_routing(step: int, expected: ModelRunnerOutput, actual: ModelRunnerOutput | None, so: SchedulerOutput,
                     ext: dict[str, str], positions: dict[str, int], skip: set[str] | frozenset,
                     summary: StepSummary, rebuilt: dict | frozenset = frozenset()) -> list[Divergence]:
    """Each request's MoE routing this step, recorded against replayed, over the tokens both sides routed (the
    same dtype or not: expert ids are compared as ids): its first token routed otherwise. Requests in `rebuilt`
    (compared within a looser tolerance: their K/V was rebuilt from a keyframe) are not compared."""
    e_rows = expected.routing(so)
    if not e_rows:
        return []
    a_rows = actual.routing(so) if actual is not None else {}
    summary.routing_not_compared = not a_rows
    divs = []
    for rid, (e_start, e) in e_rows.items():
        if rid in skip or rid in rebuilt or rid not in a_rows:  # a rebuilt K/V may tip a router's near-tie
            continue
        a_start, a = a_rows[rid]
        lo, hi = max(e_start, a_start), min(e_start + len(e), a_start + len(a))
        if hi <= lo:  # no token both sides routed
            continue
        e, a = e[lo - e_start:hi - e_start], a[lo - a_start:hi - a_start]
        summary.tokens_routed += hi - lo
        if e.shape == a.shape and np.array_equal(e, a):
            continue
        summary.routing_mismatches += 1
        if e.shape[1:] != a.shape[1:]:  # another number of MoE layers or experts per token
            t, layer = 0, None
        else:
            t, layer, _ = (int(x[0]) for x in np.nonzero(e != a))
        divs.append(Divergence(step, ext.get(rid, rid), positions.get(rid, 0), "routed_experts", internal_id=rid,
                               token_index=lo + t, moe_layer=layer,
                               expected_experts=e[t, layer].tolist() if layer is not None else e[t].ravel().tolist(),
                               actual_experts=a[t, layer].tolist() if layer is not None else a[t].ravel().tolist()))
    return divs


def _prompt_logprobs_equal(ep: LogprobsTensors | None, ap: LogprobsTensors | None, tol: Tolerance,
                           summary: StepSummary, start: int = 0) -> tuple[bool, float, tuple[int | None, int | None]]:
    """(whether one request's prompt logprobs are equal under `tol`, row by row as sampled rows are; max |Δ|; the
    rows compared of each side, None for a side without any). With `start`, the rows from `start` on of the
    recording against as many last rows of the replay."""
    if ep is None or ap is None:
        return False, 0.0, (None if ep is None else ep.logprobs.shape[0] - start,
                            None if ap is None else ap.logprobs.shape[0])
    n = ep.logprobs.shape[0] - start
    e = [a.to_numpy()[start:] for a in (ep.logprob_token_ids, ep.logprobs, ep.selected_token_ranks)]
    a = [x.to_numpy() for x in (ap.logprob_token_ids, ap.logprobs, ap.selected_token_ranks)]
    if start and n >= 0 and len(a[1]) >= n:
        a = [x[len(x) - n:] for x in a]
    if e[1].shape != a[1].shape:
        return False, 0.0, (len(e[1]), len(a[1]))
    (ids_e, lp_e, rk_e), (ids_a, lp_a, rk_a) = e, a
    if ids_e.tobytes() == ids_a.tobytes() and rk_e.tobytes() == rk_a.tobytes() and tol.equal(lp_e, lp_a):
        with np.errstate(invalid="ignore"):  # the same ids in the same order: the common case, in one pass
            d = np.abs(lp_e.astype(np.float64) - lp_a)
        d[(lp_e == lp_a) | np.isnan(d)] = 0.0
        return True, float(d.max(initial=0.0)), (n, n)
    equal, worst = True, 0.0
    for k in range(lp_e.shape[0]):
        cmp = compare_rows(Row(ids_e[k], lp_e[k], int(rk_e[k])), Row(ids_a[k], lp_a[k], int(rk_a[k])), tol)
        equal &= cmp.equal
        worst = max(worst, cmp.max_abs)
        summary.near_ties += cmp.near_tie
    return equal, worst, (n, n)


def _rows(out: ModelRunnerOutput, index: int) -> list[Row | None]:
    """The logprob rows of request `index` this step: one per generated token, or one for a discarded token (a
    partial prefill chunk: compared too, they are what the runner computed); [] without logprobs."""
    lp = out.logprobs
    return [] if lp is None else [row(lp, k) for k in lp.rows_of(index)]


def _compare_request(step: int, name: str, rid: str, pos: int, et: list[int], at: list[int], ers: list[Row | None],
                     ars: list[Row | None], foreign: bool, tol: Tolerance, summary: StepSummary,
                     actual_margins: dict[str, float] | None, greedy: bool = False,
                     draw: bool = False) -> Divergence | None:
    """One request's tokens of one step, position by position; the first position that differs, as a Divergence
    (a token there, else its logprobs), and the step's counters updated."""
    first_lp: Divergence | None = None
    for k in range(max(len(et), len(at), len(ers), len(ars))):
        e_tok = et[k] if k < len(et) else None
        a_tok = at[k] if k < len(at) else None
        er = ers[k] if k < len(ers) else None
        ar = ars[k] if k < len(ars) else None
        if foreign:  # column 0 is the draw's own logprob (a discarded row's too): take it as recorded
            if e_tok is not None and a_tok is not None and e_tok != a_tok:
                summary.foreign_draws_differ += 1
                a_tok = e_tok
            if er is not None and ar is not None:
                ar = Row(np.concatenate([er.ids[:1], ar.ids[1:]]), np.concatenate([er.values[:1], ar.values[1:]]),
                         er.rank)
        lp_diff, topk_changed, lp_equal, alike = 0.0, False, True, False
        if er is not None and ar is not None:
            summary.rows_compared += e_tok is None
            cmp = compare_rows(er, ar, tol)
            lp_diff, topk_changed, lp_equal = cmp.max_abs, cmp.topk_changed, cmp.equal
            alike = same_distribution(cmp)
            summary.topk_set_changes += topk_changed
            summary.rank_changes += cmp.rank_changed
            summary.near_ties += cmp.near_tie and e_tok == a_tok
        elif (er is None) != (ar is None):
            lp_equal = False
        summary.max_abs_logprob_diff = max(summary.max_abs_logprob_diff, lp_diff)
        if e_tok != a_tok:
            # a different token here, or one side emitted fewer (another number of drafts accepted: "drafts"); what
            # follows in this step was verified against different tokens, so this position is the divergence
            if e_tok is None or a_tok is None:
                summary.draft_mismatches += 1
                return Divergence(step, name, pos + k, "drafts", e_tok, a_tok, er.rank if er else None,
                                  ar.rank if ar else None, lp_diff, internal_id=rid)
            summary.token_mismatches += 1
            m = margin(er)
            if m is None and actual_margins is not None and k == 0:
                m = actual_margins.get(rid)
            flip = "draw" if draw else classify(m, tol, lp_diff)
            if greedy and any(r is not None and below_argmax(r) for r in (er, ar)):
                flip = "not-argmax"
            return Divergence(step, name, pos + k, "token", e_tok, a_tok, er.rank if er else None,
                              ar.rank if ar else None, lp_diff, None, m, flip, topk_changed, rid,
                              same_distribution=draw and alike)
        if not lp_equal and first_lp is None:
            sampled_diff = float(ar.values[0] - er.values[0]) if er is not None and ar is not None else None
            first_lp = Divergence(step, name, pos + k, "logprobs", e_tok, a_tok, er.rank if er else None,
                                  ar.rank if ar else None, lp_diff, sampled_diff, margin(er), None, topk_changed, rid)
    if first_lp is not None:
        summary.logprob_mismatches += 1
    return first_lp

