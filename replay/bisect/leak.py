"""`bisect_leak`: does request R read anything of its neighbours' *content*? The same-shape swap.

Leaving a neighbour out (`bisect batch`) changes the batch's shapes, and a kernel may pick another path for
another shape: batch variance, expected numerics. Here nothing changes shape. Every neighbour of R (each request
that shared a step with R, from where the replay starts to step S) is replayed with other token ids of the same
shapes (`replayer.swap`): prompt and output lengths, computed tokens, chunking, block tables and row positions
stay as recorded. In a correct dense engine R's rows then cannot move, so a deterministic engine must give R
bitwise the same logits at S; if they move, R reads something of a neighbour's (a wrong block table, a stale
buffer, a race): contamination. ddmin names the neighbour(s), and the module hooks of `bisect layers` name the
first module where R's rows part.

A proactive test: it works where the replay matches the recording, since a deterministic leak replays bitwise.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec
import torch

from replay.bisect.ddmin import Ddmin
from replay.bisect.module_compare import ModuleDiff, compare_modules
from replay.bisect.open_session import make_session
from replay.bisect.session import Run, Session, response_request
from replay.contracts import ModelRunnerOutput
from replay.errors import CannotTestError, UsageError
from replay.integrations.vllm.engines import Engines
from replay.processes.in_environment import applied, in_environment
from replay.replayer import Plant
from replay.replayer.knobs import Knobs, check_overrides, env_knobs
from replay.replayer.swap import CONTENTS

CONTAMINATION = "CONTAMINATION"
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # config.json, by family
NO_LEAK = "NO LEAK"


class SwapTest(msgspec.Struct):
    """R's logits with every swappable neighbour given one kind of other content, against the recorded content."""

    content: str  # random | shuffled | repeated
    moved: bool  # R's logits at S are not bitwise the same
    max_abs_logit_diff: float
    token: list[int]  # what R sampled at S with the neighbours swapped
    # swapped neighbours sampling at S whose own token or logprobs changed, of those: the swap took effect
    neighbours_changed: int = 0
    neighbours_sampling: int = 0


class LeakBisect(msgspec.Struct):
    """The answer of `bisect leak`."""

    capture: str
    step: int
    request: str
    verdict: str
    found: str  # CONTAMINATION or NO LEAK
    neighbours: list[str]  # those swapped (external ids)
    kept: list[str]  # neighbours kept as recorded (R reads their KV blocks; live where the replay starts)
    tests: list[SwapTest]
    minimal_set: list[str]  # a 1-minimal set of neighbours whose content moves R (empty without a leak)
    first_module: str | None  # the first module whose output for R moves with theirs
    modules: list[ModuleDiff]
    token: list[int]  # what R sampled at S with every neighbour as recorded
    re_executions: int
    runner: str = "builtin"
    notes: list[str] = []

    @property
    def contaminated(self) -> bool:
        """A neighbour's content reaches R."""
        return self.found == CONTAMINATION


def bisect_leak(path: str | os.PathLike, step: int, request: str, *, contents: tuple[str, ...] = CONTENTS,
                overrides: Knobs | None = None, runner: str | None = None, plant: Plant | None = None,
                log: Callable[[str], None] | None = None, from_start: bool = False,
                engines: Engines | None = None) -> LeakBisect:
    """Whether request `request`'s logits at step `step` move when its neighbours get other token ids of the same shapes
    (contamination), which neighbours (a 1-minimal set) and the first module that moves; the module docstring says why
    nothing else may move them. `contents`: the kinds of other content tried, in order, until one moves R. `overrides`:
    `--set` knobs (a dict, "K=V,K=V" or a list); `runner="vllm"` (or the knob) for vLLM's runner (environment knobs: in
    a fresh process started with them). `plant`: a fault added at S in every run (a planted leak,
    `STEP:R:MODULE:SIZE*NEIGHBOUR`, is what the tests find). The replay to S starts at the nearest keyframe (one before
    R's neighbours at S were scheduled where every one of them is live there: a run cannot swap one the keyframe
    rebuilds), unless `from_start`. `engines`: started vLLM engines to run on."""
    bad = [c for c in contents if c not in CONTENTS]
    if bad or not contents:
        raise UsageError(f"--contents {','.join(contents)}: expected some of {', '.join(CONTENTS)}")
    overrides = check_overrides(overrides, runner)
    env = env_knobs(overrides)
    if env and not applied(env):
        return in_environment(env, bisect_leak, path, step, request, contents=contents, overrides=overrides,
                              plant=plant, from_start=from_start)
    log = log or (lambda msg: None)
    log(f"replaying {path} to step {step}")
    s = make_session(path, step, overrides, log=log, from_start=from_start, engines=engines, watch=request,
                     request=request)
    try:
        return leak_in_session(s, request, contents=contents, plant=plant, log=log)
    finally:
        s.close()


def _moved(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    same = torch.equal(a, b)
    return not same, 0.0 if same else float((a.double() - b.double()).abs().max())


def _changed(a: ModelRunnerOutput | None, b: ModelRunnerOutput | None, ids: set[str]) -> tuple[int, int]:
    """Of the requests in `ids` that sample in both outputs, how many sampled another token or other logprobs."""
    if a is None or b is None:
        return 0, 0

    def rows(out: ModelRunnerOutput) -> dict[str, tuple]:
        lp = out.logprobs
        values = lp.logprobs.to_numpy() if lp is not None else None
        return {rid: (tuple(toks), None if values is None else
                      tuple(values[j].tobytes() for j in lp.rows_of(i)))
                for i, (rid, toks) in enumerate(zip(out.req_ids, out.sampled_token_ids)) if rid in ids and toks}

    ra, rb = rows(a), rows(b)
    both = [r for r in ra if r in rb]
    return sum(ra[r] != rb[r] for r in both), len(both)


def leak_in_session(s: Session, request: str, *, contents: tuple[str, ...] = CONTENTS, plant: Plant | None = None,
                    log: Callable[[str], None] | None = None,
                    as_recorded: Callable[[Run], None] | None = None) -> LeakBisect:
    """`bisect_leak` on a session already at its step (`explain` shares one engine among its tests).
    `as_recorded(run)`: given the step's run with every neighbour as recorded, the baseline of the swaps."""
    log = log or (lambda msg: None)
    path, step = s.path, s.step.index
    model = s.header.model
    experts = {k: v for k, v in (model.config if model is not None else {}).items() if k in MOE_KEYS and v}
    if experts:
        raise CannotTestError(f"{path}: {model.architecture or model.name} is a mixture of experts ("
                              f"{', '.join(f'{k}={v}' for k, v in experts.items())}): a token's experts follow its "
                              "content, so other content regroups the experts' GEMMs, shapes a swap cannot keep")
    rid = s.request_id(request)
    request = response_request(request, s.internal)  # (an OpenAI response's id: its prompt's request)
    if plant is not None and plant.step != step:
        raise UsageError(f"--plant is at step {plant.step}: bisect leak re-executes step {step} only")
    runs = 0

    def run(swap=None, modules=False):
        nonlocal runs
        runs += 1
        return s.run(rid, plant=plant, modules=modules, swap=swap)

    base = run()  # first: on vLLM's runner the session stands just before the step as recorded
    if as_recorded is not None:
        as_recorded(base)
    swappable = s.swap_candidates(rid)
    partly = s.partly_swappable(rid)
    kept = s.names(x for x in s.kept_as_recorded(rid) if x not in partly)
    on = " on vLLM's runner" if s.runner_kind == "vllm" else ""
    if not swappable:
        live = [x for x in s.kept_as_recorded(rid) if x in s.live]
        raise CannotTestError(f"request {request} shares no step up to {step} with a request whose content can be "
                              "swapped" + (f" (kept as recorded: {', '.join(kept)})" if kept else "") + ": nothing to "
                              "test" + (f"; {', '.join(s.names(live))} are live at the keyframe of step "
                                        f"{s.start.keyframe}, where the replay starts: --from-start can swap them"
                                        if live else ""))
    tests: list[SwapTest] = []
    moving = None
    for kind in contents:
        r = run({n: kind for n in swappable})
        moved, diff = _moved(r.logits, base.logits)
        changed, sampling = _changed(base.output, r.output, set(swappable))
        tests.append(SwapTest(kind, moved, diff, r.token, changed, sampling))
        log(f"{len(swappable)} neighbours with {kind} content ({changed} of the {sampling} sampling at the step "
            f"sample otherwise): request {request} "
            + (f"moves (max |Δlogit| {diff:.3g})" if moved else "is bitwise the same"))
        if moved:
            moving = kind
            break
    names = s.names(swappable)
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    if partly:  # (a prefix-cache hit: what R reads of theirs keeps its ids)
        shown += "; " + ", ".join(f"{n} after its first {k} tokens" for n, k in zip(s.names(partly), partly.values()))
    if moving is None:
        verdict = (f"{NO_LEAK}: request {request}'s logits at step {step}{on} are bitwise the same with its "
                   f"{len(swappable)} neighbours ({shown}) given other tokens of the same shapes "
                   f"({', '.join(t.content for t in tests)}): nothing of their content reaches it")
        if not any(t.neighbours_changed for t in tests):
            verdict += " (none of the swapped neighbours sampling at the step sampled otherwise)"
        return LeakBisect(path, step, request, verdict, NO_LEAK, names, kept, tests, [], None, [], base.token, runs,
                          s.runner_kind, s.notes)
    again = run()
    if _moved(again.logits, base.logits)[0]:
        raise CannotTestError(f"RUN-TO-RUN: request {request}'s logits at step {step}{on} differ between two replays "
                              "of the very same steps: a swap cannot be told from the noise")
    dd = Ddmin(lambda subset: _moved(run({n: moving for n in subset}).logits, base.logits)[0], log)
    dd._cache[frozenset(swappable)] = True
    log(f"ddmin over {len(swappable)} neighbours")
    minimal = dd.minimize(swappable)
    a = run(modules=True)
    b = run({n: moving for n in minimal}, modules=True)
    diffs = compare_modules(a.modules, b.modules, a.gathered | b.gathered)
    first = next((d for d in diffs if not d.equal), None)
    who = s.names(minimal)
    where = (f"; the first module whose output for it moves is {first.module} (max |Δ| {first.max_abs:.3g}, "
             f"{first.max_ulps:.3g} ULPs)") if first else ""
    verdict = (f"{CONTAMINATION}: request {request}'s logits at step {step}{on} move when "
               f"{' and '.join(who)} {'is' if len(who) == 1 else 'are'} given other tokens of the same shapes "
               f"({moving} content; max |Δlogit| {tests[-1].max_abs_logit_diff:.3g}){where}")
    return LeakBisect(path, step, request, verdict, CONTAMINATION, names, kept, tests, who,
                      first.module if first else None, diffs, base.token, runs, s.runner_kind, s.notes)

