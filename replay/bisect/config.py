"""`bisect_config`: delta debugging over the knob differences between a good and a bad configuration, to find the
minimal change that makes the replay diverge."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack

import msgspec

from replay.bisect.ddmin import Ddmin
from replay.capture import StepRange
from replay.diff import Tolerance
from replay.errors import UsageError
from replay.integrations.vllm.engine_knobs import checked_engine_args
from replay.integrations.vllm.engines import Engines, process_engines
from replay.integrations.vllm.layout import engine_args
from replay.processes.fanout import FanOut, fan_out
from replay.processes.in_environment import Environments, applied
from replay.replayer import ReplayOptions, replay_capture
from replay.replayer.knobs import Knobs, check_overrides, env_knobs


class ConfigBisect(msgspec.Struct):
    """The answer of `bisect config`."""

    capture: str
    verdict: str
    good: dict[str, str]
    bad: dict[str, str]
    minimal_change: dict[str, str]
    re_executions: int
    engine_starts: int = 0  # vLLM engines its serial replays started, in this process and in those of `env.*` knobs


def bisect_config(path: str | os.PathLike, good: Knobs, bad: Knobs, *, steps: StepRange | None = None,
                  log: Callable[[str], None] | None = None,
                  state: str | os.PathLike | None = None, how: FanOut = FanOut(),
                  engines: Engines | None = None, tol: Tolerance | None = None,
                  tolerance: Tolerance | None = None) -> ConfigBisect:
    """`good` / `bad`: knob settings, "K=V,K=V" or a dict (see `replay.replayer.KNOBS`). The good one must replay within
    `tol` (default: bitwise; `tolerance` is its other name), the bad one must diverge. `how`: where the replays run
    (`--jobs`, `--ray`); fanned out, each round of ddmin's subsets replays at once and the verdict is the serial one.
    `engines`: started vLLM engines the serial replays reuse (one per configuration tested,
    `replay.integrations.vllm.engines`; without, the bisect keeps its own). The tests that set the same `env.*` knobs
    run in one fresh process, on one engine per configuration."""
    log = log or (lambda msg: None)
    if tol is not None and tolerance is not None and tol != tolerance:
        raise UsageError(f"two tolerances given ({tol} and {tolerance}): give one")
    tol = tol or tolerance or Tolerance()
    g = check_overrides(good)
    b = check_overrides(bad)
    changes = [(k, v) for k, v in b.items() if g.get(k) != v]
    if not changes:
        raise UsageError("--good and --bad set the same knobs to the same values: nothing to bisect")
    for knobs in (g, b):  # an engine argument a replay refuses, said now rather than after the good side's engine
        if engine_args(knobs):
            checked_engine_args(knobs)

    stack = ExitStack()
    envs = stack.enter_context(Environments())  # tests with the same env.* knobs: one process, and its engines
    if engines is None:
        engines = stack.enter_context(Engines())
    before = engines.starts  # (a pool given may have started engines for earlier calls)
    starts: dict[tuple, int] = {}  # engines started in each of those processes, as they last said

    def diverges(subset) -> bool:
        knobs = {**g, **dict(subset)}
        env = env_knobs(knobs)
        if not env or applied(env):
            return replays_diverged((str(path), knobs, steps, tol), engines)
        diverged, started = envs.call(env, diverged_in_its_process, (str(path), knobs, steps, tol))
        starts[tuple(sorted(env.items()))] = started
        return diverged

    def many(subsets: list[tuple]) -> list[bool]:
        tasks = [(str(path), {**g, **dict(s)}, steps, tol) for s in subsets]
        out: list[bool] = [False] * len(tasks)
        for i, result in fan_out(replays_diverged, tasks, how):
            out[i] = result
        return out

    fanned = how.ray or how.jobs > 1
    with stack:
        dd, minimal = _minimize(Ddmin(diverges, log, state, many if fanned else None), changes, good, bad, log, tol)
    what = ", ".join(f"{k}={v}" for k, v in minimal.items())
    verdict = (f"changing {what} alone makes {path} diverge" if len(minimal) == 1
               else f"these changes together make {path} diverge (each alone does not): {what}")
    return ConfigBisect(str(path), verdict, g, b, minimal, dd.tests,
                        engines.starts - before + sum(starts.values()))


def _minimize(dd: Ddmin, changes: list[tuple[str, str]], good: str, bad: str,
              log: Callable[[str], None], tol: Tolerance) -> tuple[Ddmin, dict[str, str]]:
    """Check that the good configuration replays within tolerance and the bad one diverges, then minimize."""
    dd.prefetch([(), tuple(changes)])
    log(f"checking the good configuration ({good or 'as recorded'})")
    if dd.fails(()):
        how = "bitwise; --atol/--rtol for a replay on another runner or processor" if tol.bitwise else \
            f"beyond atol {tol.atol:g}, rtol {tol.rtol:g}"
        raise UsageError(f"the good configuration ({good or 'as recorded'}) already diverges ({how}): nothing to "
                         "bisect")
    log(f"checking the bad configuration ({bad})")
    if not dd.fails(changes):
        raise UsageError(f"the bad configuration ({bad}) replays within tolerance: nothing to bisect")
    return dd, dict(dd.minimize(changes))


Task = tuple[str, dict[str, str], StepRange | None, Tolerance]  # (capture, knobs, steps, tolerance)


def replays_diverged(task: Task, engines: Engines | None = None) -> bool:
    """One test of the bisect (in whichever process or Ray worker runs it): does the capture diverge when replayed
    with these knobs?"""
    path, knobs, steps, tol = task
    return replay_capture(path, ReplayOptions(overrides=dict(knobs), steps=steps, force=True, tolerance=tol,
                                              engines=engines)).diverged


def diverged_in_its_process(task: Task) -> tuple[bool, int]:
    """`replays_diverged` in a process of its own (`Environments`), on that process's engines, which it keeps for
    the next test with the same environment; with the engines it has started so far."""
    engines = process_engines()
    return replays_diverged(task, engines), engines.starts
