"""`bisect_batch`: does request R's result at step S depend on what else is in the batch, and on whom?

R is re-executed from the snapshot alone, with subsets of its co-scheduled requests (each keeping its recorded
number of scheduled tokens), and with k one-token padding requests. ddmin returns a 1-minimal set of neighbours
that changes R's logits, or the verdict that R is batch-invariant at S.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import msgspec
import torch

from replay.bisect.ddmin import Ddmin
from replay.bisect.session import StepSession
from replay.diff import Tolerance

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


def differs(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> bool:
    """Logits rows differ beyond the tolerance (bitwise by default)."""
    return not tol.equal(a.numpy(), b.numpy())


def bisect_batch(path: str | os.PathLike, step: int, request: str, *, tol: Tolerance | None = None,
                 overrides: dict[str, str] | None = None, hooks: list[Callable[[], Any]] | None = None,
                 log: Callable[[str], None] | None = None, state: str | os.PathLike | None = None) -> BatchBisect:
    """See the module docstring. `hooks` (callables returning hook handles) are installed for every run."""
    tol = tol or Tolerance()
    log = log or (lambda msg: None)
    log(f"replaying {path} to step {step}")
    s = StepSession(path, step, overrides, log=log)
    rid = s.request_id(request)
    others = s.neighbours(rid)
    runs = 0

    def run(keep=None, pad=0):
        nonlocal runs
        runs += 1
        return s.run(rid, keep, pad, hooks=hooks)

    alone, full = run({rid}), run(None)
    diff = float((alone.logits - full.logits).abs().max())
    log(f"request {request} alone vs in its batch of {len(others) + 1}: max |Δlogit| {diff:.3g}")
    minimal: list[str] = []
    dd = Ddmin(lambda subset: differs(run({rid, *subset}).logits, alone.logits, tol), log, state)
    if differs(full.logits, alone.logits, tol):
        dd._cache[frozenset(others)] = True
        log(f"ddmin over {len(others)} neighbours")
        minimal = dd.minimize(others)
    pads = []
    for k in PAD_SIZES:
        r = run({rid}, pad=k)
        pads.append(PadResult(k, not differs(r.logits, alone.logits, tol), float((r.logits - alone.logits).abs().max())))
    invariant = not minimal
    names = s.names(minimal)
    if invariant:
        verdict = f"request {request} is batch-invariant at step {step}: alone and with its {len(others)} neighbours it gives the same logits"
    elif len(names) == 1:
        verdict = f"request {request}'s numerics at step {step} change when {names[0]} shares its batch"
    else:
        verdict = f"request {request}'s numerics at step {step} change with {len(names)} neighbours together: {', '.join(names)}"
    size_dep = [p.padding for p in pads if not p.same_as_alone]
    if size_dep:
        verdict += f"; batch size alone changes them too (with {size_dep[0]}+ padding requests)"
    return BatchBisect(str(path), step, request, verdict, invariant, s.names(others), names, diff, alone.token,
                       full.token, pads, runs + dd.tests)
