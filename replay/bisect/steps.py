"""`bisect_steps`: the first step where recorded and replayed (or capture A and capture B) part."""

from __future__ import annotations

import dataclasses
import os

import msgspec

from replay.diff import CaptureDiff, Tolerance, diff_captures
from replay.errors import UsageError
from replay.integrations.vllm.engines import Engines
from replay.replayer import ReplayOptions, ReplayReport, replay_capture
from replay.replayer.knobs import Knobs


class StepsBisect(msgspec.Struct):
    """The answer of `bisect steps`: a verdict and the full report it rests on."""

    verdict: str
    step: int | None
    replay: ReplayReport | None = None
    capture_diff: CaptureDiff | None = None


def bisect_steps(a: str | os.PathLike, b: str | os.PathLike | None = None, *, opts: ReplayOptions | None = None,
                 tol: Tolerance | None = None, overrides: Knobs | None = None, runner: str | None = None,
                 engines: Engines | None = None) -> StepsBisect:
    """With one capture: replay it (forced mode, so every step's diff is local) and name the first divergent step.
    With two: align their requests and name the step of A where they first part. The tolerance is `tol`, else
    `opts.tolerance`; replay settings in `opts` (knobs, mode, steps) apply to one capture and are refused for two.
    `overrides`, `runner` and `engines`: as the other bisects take them (over `opts`)."""
    if overrides is not None or runner is not None or engines is not None:
        opts = (opts or ReplayOptions()).with_knobs(overrides, runner, engines)
    if tol is not None and opts is not None and opts.tolerance not in (tol, Tolerance()):
        raise UsageError(f"two tolerances given ({tol} and opts.tolerance {opts.tolerance}): give one")
    tol = tol if tol is not None else opts.tolerance if opts is not None else None
    if b is None:
        opts = opts if opts is not None else ReplayOptions()
        if tol is not None:
            opts = dataclasses.replace(opts, tolerance=tol)
        rep = replay_capture(a, opts)
        d = rep.first_divergence
        if d is None:
            return StepsBisect(f"no step of {a} diverges: all {rep.steps_replayed} replay within tolerance", None, rep)
        where = f"token {d.token_index}" if d.kind == "routed_experts" else f"output position {d.position}"
        return StepsBisect(f"step {d.step} is the first to diverge: request {d.request_id}, {where} "
                           f"({d.kind}{', ' + d.flip + ' flip' if d.flip else ''})", d.step, rep)
    replaying = _replay_settings(opts) if opts is not None else []
    if replaying:
        raise UsageError(f"bisect steps A B compares two recordings as they are: {', '.join(replaying)} replay one "
                         "capture; drop them, or bisect one capture")
    res = diff_captures(a, b, tol)
    d = res.first_divergence
    if d is None:
        return StepsBisect(f"{a} and {b} agree on every common request", None, capture_diff=res)
    where = "token" if d.kind == "routed_experts" else "output position"
    return StepsBisect(f"the captures part at step {d.a_step} of A (step {d.b_step} of B): request {d.request_id}, "
                       f"{where} {d.position}; suspect {d.suspect}", d.a_step, capture_diff=res)


# the settings that only a replay reads, as the command line names them (a tolerance judges two captures as well)
_REPLAY_SETTINGS = {"overrides": "knobs (--set)", "mode": "--mode", "steps": "steps", "plant": "plants",
                    "auto_tolerance": "--tolerance auto", "repeat": "--repeat", "force": "--force",
                    "from_keyframe": "--from-keyframe", "from_start": "--from-start", "fan_out": "--jobs/--ray"}


def _replay_settings(opts: ReplayOptions) -> list[str]:
    """The replay settings `opts` sets away from their defaults."""
    default = ReplayOptions()
    return [said for name, said in _REPLAY_SETTINGS.items() if getattr(opts, name) != getattr(default, name)]
