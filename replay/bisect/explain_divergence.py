"""`explain_divergence`: a replay parted from its recording (the first divergence, or the one at `--step S
--request R`). Bug or noise? The fewest tests that answer it, in this order:

- NOTHING TO EXPLAIN: the replay matches (exit 0);
- NOT-ARGMAX: a greedy request emitted a token that is not its side's argmax: the sampler decided it, whatever
  else the replay does (exit 1);
- RUN-TO-RUN: the replay does not repeat itself (a bug where the settings promise determinism);
- SAMPLER: a random draw flipped and the logprobs agree: the same distribution, another draw (exit 0);
- CONFIG: the replay runs under other settings than the recording (a `--set` knob, found by `bisect config`; a
  header difference; or a header that does not name its hardware, as an older capture's does), exit 0;
- CONTAMINATION: with nothing else different, R moves when its neighbours get other content of the same shapes
  (`bisect leak`), exit 1;
- BATCH VARIANCE: R's numbers move with the batch's size alone (padding), so a batch laid out otherwise than the
  recording's explains them, exit 0;
- RECORDING NOT REPEATABLE: the replay repeats itself on the recorded inputs with the recorded settings, and no
  neighbour or shape moves R, yet the recording differs: it cannot be produced again from its own inputs (exit 1).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import msgspec
import torch

from replay.bisect.batch import PAD_SIZES
from replay.bisect.commands import command_line
from replay.bisect.config import ConfigBisect, bisect_config
from replay.bisect.leak import CONTAMINATION, LeakBisect, leak_in_session
from replay.bisect.open_session import make_session
from replay.bisect.promise import determinism_promise, promise_clause
from replay.capture import StepRange
from replay.diff import Divergence, Tolerance
from replay.errors import CannotTestError, UsageError
from replay.inspect.show import show_steps
from replay.integrations.vllm.engines import Engines
from replay.replayer import ReplayOptions, replay_capture
from replay.replayer.knobs import Knobs
from replay.replayer.suspects import LORA_SLOTS

NOTHING = "NOTHING TO EXPLAIN"
RUN_TO_RUN = "RUN-TO-RUN"
NOT_ARGMAX = "NOT-ARGMAX"
SAMPLER = "SAMPLER"
CONFIG = "CONFIG"
BATCH_VARIANCE = "BATCH VARIANCE"
NOT_REPEATABLE = "RECORDING NOT REPEATABLE"
BUGS = (CONTAMINATION, NOT_ARGMAX, NOT_REPEATABLE)


class DivergenceExplanation(msgspec.Struct):
    """The answer of `explain CAPTURE`."""

    capture: str
    found: str  # one of the classes above
    verdict: str
    bug: bool  # exit 1
    command: str = ""  # what reproduces the evidence
    divergence: Divergence | None = None
    evidence: list[str] = []
    config: ConfigBisect | None = None
    leak: LeakBisect | None = None
    re_executions: int = 0
    runner: str = "builtin"
    notes: list[str] = []
    data_lost: list[str] = []  # what the capture lost: the explanation is of its readable prefix


def _pick(divergences: list[Divergence], step: int | None, names: set[str] | None) -> Divergence | None:
    """The first divergence at `step` (any where None) of the request `names` name (its external and internal ids;
    any where None)."""
    for d in divergences:
        if (step is None or d.step == step) and (names is None or names & {d.request_id, d.internal_id}):
            return d
    return None


def explain_divergence(path: str | os.PathLike, opts: ReplayOptions | None = None, *, step: int | None = None,
                       request: str | None = None, log: Callable[[str], None] | None = None,
                       overrides: Knobs | None = None, runner: str | None = None,
                       engines: Engines | None = None) -> DivergenceExplanation:
    """Bug or noise: the class of a replay's first divergence (NOT-ARGMAX, RUN-TO-RUN, SAMPLER, CONFIG, CONTAMINATION,
    BATCH VARIANCE or RECORDING NOT REPEATABLE; the module docstring gives the order), with the evidence and a command
    that reproduces it. `opts`: how to replay (knobs, tolerance, runner); `step`/`request` pick the divergence (default:
    the first); `overrides`, `runner` and `engines` as the bisects take them (over `opts`)."""
    log = log or (lambda msg: None)
    path = str(path)
    opts = opts or ReplayOptions()
    if overrides is not None or runner is not None or engines is not None:
        opts = opts.with_knobs(overrides, runner, engines)
    runner = opts.overrides.get("runner", "builtin")
    steps = StepRange(step, step) if step is not None else opts.steps
    internal = None
    if request is not None:  # a name no step schedules is a typo, not a request that matches
        shown = show_steps(path, steps, request, limit=1)
        internal = shown.request
        if request not in (internal, shown.external_ids.get(internal)):  # a response's id: its one prompt's request
            request = shown.external_ids.get(internal, internal)
    base = dataclasses.replace(opts, repeat=max(opts.repeat, 2), steps=steps)
    log(f"replaying {path} twice" + (f" to step {step}" if step is not None else ""))
    rep = replay_capture(path, base)
    runs = 2
    d = _pick(rep.divergences, step, None if request is None else {request, internal})
    where = f" at step {step}" + (f" for request {request}" if request else "") if step is not None else ""
    common = dict(runner=runner, notes=list(rep.environment_differences), data_lost=list(rep.data_lost))
    if d is None:
        tol = rep.tolerance
        how = "bitwise" if tol.bitwise else f"within atol {tol.atol:g}, rtol {tol.rtol:g}"
        return DivergenceExplanation(path, NOTHING, f"{NOTHING}: the replay of {path}{where} matches its recording "
                                     f"({how})", False, re_executions=runs, **common)
    at = f"request {d.request_id} at step {d.step}, output position {d.position}"
    command = rep.repro or ""
    repeats = not rep.run_to_run or rep.run_to_run.startswith("deterministic")
    if d.flip == "not-argmax":
        whose = " and ".join(w for w, rank in (("the recording's", d.expected_rank), ("the replay's", d.actual_rank))
                             if rank not in (None, 1))
        evidence = [] if repeats else [f"the replay does not repeat itself either ({rep.run_to_run})"]
        return DivergenceExplanation(path, NOT_ARGMAX, f"{NOT_ARGMAX}: {at} is a greedy token that is not its side's "
                                     f"argmax (recorded rank {d.expected_rank}, replayed rank {d.actual_rank}): "
                                     f"{whose or 'a'} sampler{'s' * (' and ' in whose)} decided it, not the "
                                     "numerics", True, command, d,
                                     evidence, re_executions=runs, **common)
    if not repeats:
        promise = determinism_promise(path, opts.overrides)
        return DivergenceExplanation(path, RUN_TO_RUN, f"{RUN_TO_RUN}: the replay does not repeat itself "
                                     f"({rep.run_to_run}); {at} cannot be pinned on the recording"
                                     + promise_clause(promise), bool(promise),
                                     f"{command} --repeat 2", d, re_executions=runs, **common)
    if d.flip == "draw" and d.same_distribution:
        return DivergenceExplanation(path, SAMPLER, f"{SAMPLER}: {at} drew token {d.actual_token} where the recording "
                                     f"drew {d.expected_token}, from the same distribution (its logprobs agree within "
                                     "the tolerance): another draw, not other numbers", False, command, d,
                                     re_executions=runs, **common)
    config = _config(path, rep, opts, d, at, command, runs, common, log)
    if config is not None:
        return config
    out = _batch_or_leak(path, opts, d, at, command, runs, common, log)
    if rep.suspect.startswith(LORA_SLOTS):  # vLLM's runner, whose slots may hold other adapters than recorded
        out.evidence = [*out.evidence, f"suspect: {rep.suspect}"]
    return out


def _config(path, rep, opts, d, at, command, runs, common, log) -> DivergenceExplanation | None:
    """CONFIG, when the replay runs otherwise than the recording: the knobs given (bisected), a header difference,
    or a recording that does not name its hardware."""
    knobs = {k: v for k, v in opts.overrides.items() if k != "runner"}
    if knobs:
        log(f"bisecting the knobs {_text(knobs)}")
        good = {k: v for k, v in opts.overrides.items() if k == "runner"}
        try:
            found = bisect_config(path, good=_text(good), bad=_text(opts.overrides), steps=StepRange(0, d.step),
                                  log=log, engines=opts.engines, tolerance=rep.tolerance)
        except UsageError as e:
            found = None
            log(f"bisect config: {e}")
        if found is not None:
            return DivergenceExplanation(path, CONFIG, f"{CONFIG}: {at} moves because of the settings: "
                                         f"{found.verdict}", False, _config_command(path, good, opts, d.step,
                                                                                    rep.tolerance),
                                         d, [found.verdict], config=found,
                                         re_executions=runs + found.re_executions, **common)
    # vllm-cpu's LoRA slots are a setting only where the builtin runner has none: on vLLM's runner the slots are
    # the engine's own, and what then parts the replay is for the tests below to class
    lora_on_vllm = rep.suspect.startswith(LORA_SLOTS) and opts.overrides.get("runner") == "vllm"
    if rep.suspect and rep.suspect != rep.unknown and not lora_on_vllm:
        # a vLLM capture on the builtin runner: a bug of vLLM's kernels is not in ours, so only its runner can tell
        own = ("; --runner vllm replays vLLM's own kernels, where a bug of theirs would show"
               if "recorded vllm" in rep.suspect and opts.overrides.get("runner", "builtin") != "vllm" else "")
        return DivergenceExplanation(path, CONFIG, f"{CONFIG}: {at} parts where the replay runs otherwise than the "
                                     f"recording: {rep.suspect}{own}", False, command, d,
                                     list(rep.environment_differences), re_executions=runs, **common)
    if rep.unknown:
        log("replaying under the cross-hardware tolerance")
        first = opts.steps.first if opts.steps else 0
        auto = replay_capture(path, dataclasses.replace(opts, auto_tolerance=True, repeat=1,
                                                        steps=StepRange(first, d.step)))
        a = auto.first_divergence
        cross = f"atol {auto.tolerance.atol:g}"
        # the first divergence beyond that tolerance may be another request's, at another step: name whose it is
        where = "" if a is None or (a.request_id, a.step) == (d.request_id, d.step) else \
            f"request {a.request_id} at step {a.step}, "
        within = (f"within the cross-hardware tolerance ({cross}) it matches" if a is None
                  else f"the replay parts beyond the cross-hardware tolerance too ({cross}; {where}{_how(a)}), so "
                       "what the header does not name (the processor, a thread setting) is the suspect")
        rerun = command_line(["replay", "run", path, "--diff", "--steps", f"{first}-{d.step}", "--tolerance", "auto"],
                         opts.overrides)
        return DivergenceExplanation(path, CONFIG, f"{CONFIG} (hardware unknown): {at} parts, and {rep.unknown}; "
                                     f"{within}", False, rerun, d, [rep.unknown, within], re_executions=runs + 1,
                                     **common)
    return None


def _how(d: Divergence) -> str:
    """How a divergence parts, in the words that fit its kind: a token flip may part by no logprob at all."""
    if d.kind == "token":
        return f"token {d.expected_token} became {d.actual_token}, max |Δlogprob| {d.max_abs_logprob_diff:.3g}"
    if d.kind in ("logprobs", "prompt_logprobs"):
        return f"max |Δlogprob| {d.max_abs_logprob_diff:.3g}"
    return f"a {d.kind.replace('_', ' ')} divergence"


def _plant_text(p) -> str:
    return f"{p.step}:{p.request}:{p.module}:{p.size:g}" + (f"*{p.source}" if p.source else "")


def _text(knobs: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in knobs.items())


def _config_command(path: str, good: dict[str, str], opts: ReplayOptions, step: int, tol: Tolerance) -> str:
    """`bisect config` as the explanation ran it: the runner on both sides, its steps and its tolerance."""
    args = ["replay", "bisect", "config", path, *(["--good", _text(good)] if good else []),
            "--bad", _text(opts.overrides), "--steps", f"0-{step}"]
    if not tol.bitwise:
        args += ["--atol", f"{tol.atol:g}", "--rtol", f"{tol.rtol:g}"]
    return command_line(args, {})


def _batch_or_leak(path, opts, d, at, command, runs, common, log) -> DivergenceExplanation:
    """Nothing differs in the settings and the replay repeats itself: the swap, then the padding sweep, at R's step."""
    r = d.internal_id or d.request_id  # (watched: the swap gives its neighbours other content throughout)
    s = make_session(path, d.step, opts.overrides, log=log, from_start=opts.from_start, engines=opts.engines,
                     watch=r, request=r)
    try:
        rid = s.request_id(d.internal_id or d.request_id)
        leak = None
        if s.swap_candidates(rid):
            leak = leak_in_session(s, d.request_id, log=log,
                                   plant=opts.plant if opts.plant and opts.plant.step == d.step else None)
            runs += leak.re_executions
            if leak.contaminated:
                planted = [] if opts.plant is None else ["--plant", _plant_text(opts.plant)]
                said = leak.verdict.removeprefix(CONTAMINATION + ": ")
                return DivergenceExplanation(path, CONTAMINATION, f"{CONTAMINATION}: {at}: {said}", True,
                                             command_line(["replay", "bisect", "leak", path, "--step", str(d.step),
                                                       "--request", d.request_id, *planted], opts.overrides,
                                                      opts.from_start), d, [], leak=leak, re_executions=runs,
                                             **common)
        alone = s.run(rid, keep={rid})
        moved = []
        for k in (k for k in PAD_SIZES if k <= s.max_padding):
            r = s.run(rid, keep={rid}, pad=k)
            runs += 1
            if not torch.equal(r.logits, alone.logits):
                moved.append((k, float((r.logits - alone.logits).abs().max())))
        runs += 1
    except CannotTestError as e:
        log(f"cannot re-execute the step: {e}")
        leak, moved = None, []
    finally:
        s.close()
    evidence = [leak.verdict] if leak is not None else []
    if moved:
        k, diff = moved[0]
        evidence.append(f"with {k} one-token padding request(s) beside it, request {d.request_id}'s logits at step "
                        f"{d.step} move by up to {diff:.3g}")
        return DivergenceExplanation(path, BATCH_VARIANCE, f"{BATCH_VARIANCE}: {at}: no neighbour's content moves it, "
                                     f"but the batch's size alone does (from {k} padding request(s)): a batch laid "
                                     "out otherwise than the recording's explains it", False,
                                     command_line(["replay", "bisect", "batch", path, "--step", str(d.step),
                                                   "--request", d.request_id], opts.overrides, opts.from_start), d,
                                     evidence, leak=leak, re_executions=runs, **common)
    return DivergenceExplanation(path, NOT_REPEATABLE, f"{NOT_REPEATABLE}: {at}: the replay repeats itself with the "
                                 "recorded settings, and neither a neighbour's content nor the batch's size moves "
                                 "it, yet the recording differs: it cannot be produced again from its own inputs",
                                 True, command, d, evidence, leak=leak, re_executions=runs, **common)
