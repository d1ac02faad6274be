"""`bisect_config`: delta debugging over the knob differences between a good and a bad configuration, to find the
minimal change that makes the replay diverge."""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec

from replay.bisect.ddmin import Ddmin
from replay.capture import StepRange
from replay.errors import UsageError
from replay.integrations.vllm.engines import Engines
from replay.processes.fanout import FanOut, fan_out
from replay.replayer import ReplayOptions, parse_overrides, replay_capture
from replay.replayer.knobs import split_knobs


class ConfigBisect(msgspec.Struct):
    """The answer of `bisect config`."""

    capture: str
    verdict: str
    good: dict[str, str]
    bad: dict[str, str]
    minimal_change: dict[str, str]
    re_executions: int


def bisect_config(path: str | os.PathLike, good: str, bad: str, *, steps: StepRange | None = None,
                  log: Callable[[str], None] | None = None,
                  state: str | os.PathLike | None = None, how: FanOut = FanOut(),
                  engines: Engines | None = None) -> ConfigBisect:
    """`good` / `bad`: "K=V,K=V" knob settings (see `replay.replayer.KNOBS`). The good one must replay within
    tolerance, the bad one must diverge. `how`: where the replays run (`--jobs`, `--ray`); fanned out, each round
    of ddmin's subsets replays at once and the verdict is the serial one. `engines`: started vLLM engines the serial
    replays reuse (one per configuration tested, `replay.integrations.vllm.engines`)."""
    log = log or (lambda msg: None)
    g = parse_overrides(split_knobs(good))
    b = parse_overrides(split_knobs(bad))
    changes = [(k, v) for k, v in b.items() if g.get(k) != v]
    if not changes:
        raise UsageError("--good and --bad set the same knobs to the same values: nothing to bisect")

    def diverges(subset) -> bool:
        return replays_diverged((str(path), {**g, **dict(subset)}, steps), engines)

    def many(subsets: list[tuple]) -> list[bool]:
        tasks = [(str(path), {**g, **dict(s)}, steps) for s in subsets]
        out: list[bool] = [False] * len(tasks)
        for i, result in fan_out(replays_diverged, tasks, how):
            out[i] = result
        return out

    fanned = how.ray or how.jobs > 1
    dd = Ddmin(diverges, log, state, many if fanned else None)
    dd.prefetch([(), tuple(changes)])
    log(f"checking the good configuration ({good or 'as recorded'})")
    if dd.fails(()):
        raise UsageError(f"the good configuration ({good or 'as recorded'}) already diverges: nothing to bisect")
    log(f"checking the bad configuration ({bad})")
    if not dd.fails(changes):
        raise UsageError(f"the bad configuration ({bad}) replays within tolerance: nothing to bisect")
    minimal = dict(dd.minimize(changes))
    what = ", ".join(f"{k}={v}" for k, v in minimal.items())
    verdict = (f"changing {what} alone makes {path} diverge" if len(minimal) == 1
               else f"these changes together make {path} diverge (each alone does not): {what}")
    return ConfigBisect(str(path), verdict, g, b, minimal, dd.tests)


def replays_diverged(task: tuple[str, dict[str, str], StepRange | None], engines: Engines | None = None) -> bool:
    """One test of the bisect (in whichever process or Ray worker runs it): does the capture diverge when replayed
    with these knobs?"""
    path, knobs, steps = task
    return replay_capture(path, ReplayOptions(overrides=dict(knobs), steps=steps, force=True,
                                              engines=engines)).diverged
