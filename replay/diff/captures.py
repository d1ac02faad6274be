"""`diff_captures`: two captures of the same workload, recorded separately, compared request by request.

Steps do not line up between runs (another batch size, another engine, another machine), so requests are aligned
by external id (else by prompt and arrival order: also when the two runs share no id, as two runs of a server that
names its requests at random do) and compared output position by output position. An unseeded random request's
draws are independent from run to run: it is compared up to the first token the two drew otherwise. At the first
divergence both sides' batches are shown: if they differ, batch variance is the suspect; if they are the same,
run-to-run nondeterminism is.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NoReturn

import msgspec
import numpy as np

from replay.capture import CaptureReader, Damage, Header, RequestAdded, Step
from replay.contracts import SAMPLING_EPS
from replay.diff.rules import (
    Row,
    Tolerance,
    classify,
    compare_rows,
    margin,
    row,
    same_distribution,
)
from replay.diff.step import BatchComposition, batch_composition
from replay.diff.verdict import near_ties
from replay.errors import CaptureDamagedError, UsageError
from replay.provenance import hardware_differences, header_differences, is_suspect


@dataclass(slots=True)
class AlignedRun:
    """What one capture says about each request, keyed as `replay diff` aligns two runs: the external id, else
    the prompt and its arrival order among equal prompts."""

    prompts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # key -> prompt
    order: list[str] = field(default_factory=list)  # keys in arrival order
    # key -> (step, token, logprobs row) per output position
    outputs: dict[str, list[tuple[int, int, Row | None]]] = field(default_factory=lambda: defaultdict(list))
    batches: dict[int, BatchComposition] = field(default_factory=dict)
    key_of: dict[str, str] = field(default_factory=dict)  # internal id -> key
    names: dict[str, str] = field(default_factory=dict)  # key -> the request's name in this capture
    header: Header | None = None
    random: set[str] = field(default_factory=set)  # keys of random-sampling requests: their flips are draws
    unseeded: set[str] = field(default_factory=set)  # ... without a seed: their draws differ from run to run
    # key -> token index -> (step, its MoE routing [num_moe_layers, top_k]), where the capture kept routing
    routing: dict[str, dict[int, tuple[int, np.ndarray]]] = field(default_factory=lambda: defaultdict(dict))
    lost: list[str] = field(default_factory=list)  # where the capture lost data (`Damage.describe`)
    # keys of requests live where data was lost: their outputs stop there, so a shorter run is no divergence
    cut: set[str] = field(default_factory=set)

    def name(self, key: str) -> str:
        """The request's name in this capture (its external id, else its id)."""
        return self.names.get(key) or key.partition(":")[2]


class TokenMismatch(msgspec.Struct, omit_defaults=True):
    """The first position where A and B part, with each side's step and batch."""

    request_id: str
    position: int
    kind: str  # "token" | "logprobs" | "length" | "routed_experts" (then `position` is the token's index, prompt first)
    a_step: int | None
    b_step: int | None
    a_token: int | None = None
    b_token: int | None = None
    max_abs_logprob_diff: float = 0.0
    margin: float | None = None
    flip: str | None = None
    a_batch: BatchComposition | None = None
    b_batch: BatchComposition | None = None
    batches_differ: bool = False
    suspect: str = ""  # "hardware (...)" | "batch variance" | "configuration (...)" | "run-to-run nondeterminism"
    a_rank: int | None = None  # the token's rank on each side, where logprobs were recorded
    b_rank: int | None = None
    topk_changed: bool = False  # the top-k ids or their order differ
    # a "draw" flip (a random-sampling request) whose logprobs are equal within the tolerance: another draw
    same_distribution: bool = False
    moe_layer: int | None = None  # "routed_experts": the first MoE layer that routed the token otherwise
    a_experts: list[int] | None = None  # and each side's experts there, in router order
    b_experts: list[int] | None = None


class CaptureDiff(msgspec.Struct):
    """The answer of `replay diff A B`. JSON carries `diverged` and `first_divergence`."""

    a: str
    b: str
    diverged: bool
    first_divergence: TokenMismatch | None
    requests_compared: int
    requests_diverged: int
    only_in_a: list[str]
    only_in_b: list[str]
    tolerance: Tolerance
    config_differences: list[str] = []  # header fields that differ between A and B (replay.provenance), "k: A vs B"
    # positions compared equal under the tolerance whose rank or top-k order moved (see replay.diff.rules)
    near_ties: int = 0
    # what differs but cannot change numerics by itself (platform, Python, executor backend): shown with -v
    host_differences: list[str] = []
    data_lost: list[str] = []  # "A: ..." / "B: ...": where a capture lost data (compared up to it)
    aligned_by_prompt: bool = False  # the runs share no request id: requests aligned by prompt and arrival order
    # unseeded random requests whose draws parted (from equal logprobs): compared up to there, not divergences
    draws_differ: int = 0
    verdict: str = ""  # the sentence the terminal and the HTML report lead with (`capture_diff_verdict`)


def _nothing_to_compare(a_path, b_path, a: AlignedRun, b: AlignedRun) -> NoReturn:
    """No output position both captures hold: exit 3 where one lost data, else a usage error; never a MATCH."""
    lost = next(((p, x.lost[0]) for p, x in ((a_path, a), (b_path, b)) if x.lost), None)
    if lost is not None:
        raise CaptureDamagedError(lost[0], f"no request readable in both captures to compare ({lost[1]})")
    either = any(k in b.prompts for k in a.order)
    raise UsageError(f"{a_path} and {b_path}: " + ("no request both hold sampled a token: nothing to compare"
                                                   if either else "no request in common (two workloads?)"))


def _sampling_signature(req) -> tuple:
    """What makes two requests of one prompt different requests: aligned by prompt and arrival order alone, a seeded
    request of one run met the greedy one of the other whenever concurrent clients' requests arrived in another
    order (and was called a random draw)."""
    sp = req.sampling_params
    lora = req.lora_request
    adapter = (lora.type, lora.size, lora.summary) if lora is not None else None
    if sp is None:
        return (None, adapter)
    greedy = sp.temperature < SAMPLING_EPS
    return (greedy, None if greedy else (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed), sp.max_tokens,
            sp.logprobs, sp.prompt_logprobs, adapter)


def read_aligned(path: str | os.PathLike, by_prompt: bool = False) -> AlignedRun:
    """Read a capture's requests, outputs and batches, keyed for alignment with another run's (`by_prompt`: by prompt
    and arrival order even where requests have external ids)."""
    side = AlignedRun()
    seen_prompts: dict[tuple, int] = defaultdict(int)
    finished: set[str] = set()
    marks: dict[str, int] = {}  # key -> its outputs so far where data was first lost while it was live
    limits: dict[str, int | None] = {}  # key -> max_tokens
    lost = seen = 0  # damage entries that lost records so far; damage entries of any kind looked at
    gaps: list[Damage] = []  # steps missing where the reader saw no damage (a capture recovered from a loss)
    last, told = None, False  # the last step read; whether the reader named a loss since
    with CaptureReader(path) as r:
        side.header = r.header
        for rec in r.records():
            if len(r.damage) > seen:  # (a loss is rare: the check costs a record nothing else)
                seen, told = len(r.damage), True
                lost = _mark(side, r.damage + gaps, lost, finished, marks)
            if isinstance(rec, Step):
                if last is not None and rec.index != last + 1 and not told:
                    gaps.append(Damage("gap", "steps missing", first_step=last + 1, last_step=rec.index - 1))
                    lost = _mark(side, r.damage + gaps, lost, finished, marks)
                last, told = rec.index, False
            if isinstance(rec, RequestAdded):
                req = rec.request
                prompt = tuple(req.prompt_token_ids or ())
                if req.external_req_id is not None and not by_prompt:
                    key = f"id:{req.name}"
                else:  # no user id: the n-th request with this prompt and sampling
                    twin = (prompt, _sampling_signature(req))
                    key = f"prompt:{hash(twin)}:{seen_prompts[twin]}"
                    seen_prompts[twin] += 1
                side.key_of[req.request_id] = key
                side.names[key] = req.name
                side.prompts[key] = prompt
                sp = req.sampling_params
                if sp is not None and sp.temperature >= SAMPLING_EPS:
                    side.random.add(key)
                    if sp.seed is None:
                        side.unseeded.add(key)
                limits[key] = sp.max_tokens if sp is not None else None
                side.order.append(key)
            elif isinstance(rec, Step):
                finished.update(rec.scheduler_output.finished_req_ids)
                mro = rec.model_runner_output
                if mro is None:
                    continue
                names = {rid: side.key_of.get(rid, f"id:{rid}") for rid in mro.req_ids}
                side.batches[rec.index] = batch_composition(rec.index, rec.scheduler_output,
                                                            {k: side.name(v) for k, v in names.items()})
                for rid, (start, rows) in mro.routing(rec.scheduler_output).items():
                    key = names.get(rid) or side.key_of.get(rid, f"id:{rid}")
                    side.routing[key].update((start + t, (rec.index, r)) for t, r in enumerate(rows))
                for i, rid in enumerate(mro.req_ids):
                    first = mro.logprobs.first_row(i) if mro.logprobs is not None else 0
                    for k, t in enumerate(mro.sampled_token_ids[i]):  # several per step with spec decode
                        side.outputs[names[rid]].append((rec.index, t, row(mro.logprobs, first + k)))
        _mark(side, r.damage + gaps, lost, finished, marks)  # a lost tail
        side.lost = [d.describe() for d in r.damage + gaps]
    for key, n in marks.items():
        outputs = side.outputs.get(key, [])
        if len(outputs) > n:  # it went on after the gap: those outputs stand at positions the gap shifted
            del outputs[n:]
            side.cut.add(key)
        elif limits.get(key) is None or n < limits[key]:  # (its finish, or more of it, may be what was lost)
            side.cut.add(key)
    return side


def _mark(side: AlignedRun, damage: list, lost: int, finished: set[str], marks: dict[str, int]) -> int:
    """Where the reader found data lost since the last look (a bad seek index loses none), mark the requests
    that had arrived and not finished (vLLM names a request finished one step late) with their outputs so far.
    Returns the count of losses seen."""
    now = sum(d.kind != "index" for d in damage)
    if now > lost:
        for rid, key in side.key_of.items():
            if rid not in finished and key not in marks:
                marks[key] = len(side.outputs.get(key, ()))
    return now


def _same_batch(a: BatchComposition | None, b: BatchComposition | None) -> bool:
    """The same shapes: as many requests, scheduling the same numbers of tokens (whatever the runs named them)."""
    return a is not None and b is not None and sorted(a.num_scheduled_tokens.values()) == sorted(
        b.num_scheduled_tokens.values())


def _routing_mismatch(name: str, ra: dict[int, tuple[int, np.ndarray]],
                      rb: dict[int, tuple[int, np.ndarray]]) -> TokenMismatch | None:
    """The first token both captures routed, and routed to other experts; None where none was (or none kept)."""
    for t in sorted(ra.keys() & rb.keys()):
        (sa, ea), (sb, eb) = ra[t], rb[t]
        if ea.shape == eb.shape and np.array_equal(ea, eb):
            continue
        layer = int(np.nonzero(ea != eb)[0][0]) if ea.shape == eb.shape else None
        pick = (lambda e: e[layer].tolist()) if layer is not None else (lambda e: e.ravel().tolist())
        return TokenMismatch(name, t, "routed_experts", sa, sb, moe_layer=layer,
                             a_experts=pick(ea), b_experts=pick(eb))
    return None


def diff_captures(a_path: str | os.PathLike, b_path: str | os.PathLike, tol: Tolerance | None = None) -> CaptureDiff:
    """Compare two recorded runs of one workload request by request: each request's sampled tokens and logprobs in
    A against B's (aligned by id, else by prompt, sampling and arrival order), to the first divergence, with a
    suspect from how the headers and batches differ; `.verdict` is the sentence `replay diff` prints."""
    tol = tol or Tolerance()
    a, b = read_aligned(a_path), read_aligned(b_path)
    by_prompt = not any(k in b.prompts for k in a.order) and (a.names or b.names)
    if by_prompt:  # no id in common (a server names requests at random): the prompts, in arrival order
        a, b = read_aligned(a_path, by_prompt=True), read_aligned(b_path, by_prompt=True)
    differences = header_differences(a.header, b.header)
    common = [k for k in a.order if k in b.prompts and (a.outputs.get(k) or b.outputs.get(k))]
    if not common:  # an empty comparison is no match
        _nothing_to_compare(a_path, b_path, a, b)
    first: TokenMismatch | None = None
    diverged_reqs = near_ties = draws_differ = positions = 0
    for key in common:
        oa, ob = a.outputs.get(key, []), b.outputs.get(key, [])
        name = a.name(key)
        mismatch = None
        for pos in range(max(len(oa), len(ob))):
            if pos >= len(oa) or pos >= len(ob):
                if key in (a.cut if pos >= len(oa) else b.cut):
                    break  # the shorter side lost the rest with its capture's damage: no divergence
                sa, sb = (oa[pos][0] if pos < len(oa) else None), (ob[pos][0] if pos < len(ob) else None)
                mismatch = TokenMismatch(name, pos, "length", sa, sb)
                break
            (sa, ta, ra), (sb, tb, rb) = oa[pos], ob[pos]
            positions += 1
            lp_diff, lp_equal, alike = 0.0, (ra is None) == (rb is None), False
            if ra is not None and rb is not None:
                cmp = compare_rows(ra, rb, tol)
                lp_diff, lp_equal, alike = cmp.max_abs, cmp.equal, same_distribution(cmp)
                near_ties += cmp.near_tie and ta == tb
            m = margin(ra)
            unseeded_draw = ta != tb and key in a.unseeded | b.unseeded
            if unseeded_draw and (alike or lp_equal):
                draws_differ += 1  # another draw from the same logprobs, by a generator no run repeats
                break
            if ta != tb:
                draw = key in a.random
                mismatch = TokenMismatch(name, pos, "token", sa, sb, ta, tb, lp_diff, m,
                                         "draw" if draw else classify(m, tol, lp_diff),
                                         same_distribution=draw and alike)
                break
            if not lp_equal:
                mismatch = TokenMismatch(name, pos, "logprobs", sa, sb, ta, tb, lp_diff, m,
                                         a_rank=ra.rank if ra else None, b_rank=rb.rank if rb else None,
                                         topk_changed=cmp.topk_changed if ra is not None and rb is not None else False)
                break
        routed = _routing_mismatch(name, a.routing.get(key, {}), b.routing.get(key, {}))
        if routed is not None and (mismatch is None or mismatch.a_step is None or routed.a_step <= mismatch.a_step):
            mismatch = routed  # the routing decided what followed
        if mismatch is None:
            continue
        diverged_reqs += 1
        order_key = (mismatch.a_step if mismatch.a_step is not None else 1 << 62, mismatch.position)
        if first is None or order_key < (first.a_step if first.a_step is not None else 1 << 62, first.position):
            first = mismatch
    if first is None and not positions:  # every common request's tokens lost on one side: still no comparison
        _nothing_to_compare(a_path, b_path, a, b)
    if first is not None:
        first.a_batch = a.batches.get(first.a_step) if first.a_step is not None else None
        first.b_batch = b.batches.get(first.b_step) if first.b_step is not None else None
        first.batches_differ = not _same_batch(first.a_batch, first.b_batch)
        knobs = [d.as_pair() for d in differences if is_suspect(d)]
        hardware = [d.as_pair() for d in hardware_differences(differences)]
        layout = [d.as_pair() for d in differences if d.affects == "layout"]
        version = [d.as_pair() for d in differences if d.field == "engine_version"]
        if first.same_distribution:  # equal logprobs, another random draw: the sampler, whatever else differs
            first.suspect = "the sampler: same distribution, another draw" + (f" ({version[0]})" if version else "")
        elif version and not any(d.field == "engine" for d in differences):  # an upgrade: kernels and samplers
            first.suspect = "configuration (" + "; ".join(version + [k for k in knobs if k not in version][:2]) + ")"
        elif hardware:  # the first thing to rule out: other kernels compute other bits whatever the batch
            first.suspect = "hardware (" + "; ".join(hardware[:3]) + ")"
        elif layout:  # another parallel layout or compilation reduces in another order
            first.suspect = "layout (" + "; ".join(layout[:3]) + ")"
        elif first.batches_differ:
            first.suspect = "batch variance"
        elif knobs:
            first.suspect = "configuration (" + "; ".join(knobs[:3]) + ")"
        else:
            first.suspect = "run-to-run nondeterminism"
    res = CaptureDiff(str(a_path), str(b_path), first is not None, first, len(common), diverged_reqs,
                      [a.name(k) for k in a.order if k not in b.prompts],
                      [b.name(k) for k in b.order if k not in a.prompts],
                      tol, [d.as_pair() for d in differences if d.affects != "host"], near_ties,
                      [d.as_pair() for d in differences if d.affects == "host"],
                      [f"A: {x}" for x in a.lost] + [f"B: {x}" for x in b.lost], bool(by_prompt), draws_differ)
    res.verdict = capture_diff_verdict(res)
    return res


def capture_diff_verdict(res: CaptureDiff) -> str:
    """The sentence `replay diff A B` leads with."""
    d = res.first_divergence
    tol = res.tolerance
    within = "" if tol.bitwise else f" within atol {tol.atol:g}, rtol {tol.rtol:g}"
    if d is None:
        lost = " (data was lost: the readable prefixes match)" if res.data_lost else ""
        return (f"MATCH: every common request produced the same tokens and logprobs{within}{near_ties(res.near_ties)}"
                f"{lost}")
    where = "token" if d.kind == "routed_experts" else "output position"
    return (f"DIVERGED: {res.requests_diverged} request(s) differ; first: request {d.request_id}, {where} "
            f"{d.position}{near_ties(res.near_ties)}")
