"""Shared pieces of the command line: the typer apps, error handling, the one output path, common options."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperGroup

from replay.capture.reading.liveness import still_written
from replay.capture.reading.step_range import StepRange
from replay.diff.rules import DEFAULT_TIE_MARGIN
from replay.errors import (
    EXIT_DAMAGED,
    EXIT_OK,
    EXIT_USAGE,
    VERBOSE_ENV,
    ReplayError,
    UsageError,
)

if TYPE_CHECKING:
    from replay.capture import Damage
    from replay.processes.fanout import FanOut
    from replay.replayer import ReplayOptions

# `replay --help` lists the commands in the order of a user's day, then the rest as they were registered
DAY = ("record", "snapshot", "run", "diff", "explain", "trainer", "info", "show", "report", "bisect", "stress",
       "check")


class _DayOrder(TyperGroup):
    """The command group, listing its commands in DAY's order."""

    def list_commands(self, ctx: Any) -> list[str]:
        """Command names, DAY's first."""
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: (DAY.index(n) if n in DAY else len(DAY), names.index(n)))


app = typer.Typer(
    name="replay",
    cls=_DayOrder,
    help="Record-and-replay debugger for LLM inference engines that speak vLLM's v1 data contracts.",
    epilog="Start with `replay demo`. Recipes (record a vLLM server and replay it, read a verdict, diff, bisect, "
           "check in CI): README.md; every command in detail: docs/guide.md.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
bisect_app = typer.Typer(help="Narrow a divergence down: to a step, a co-batched request, a module, a knob.",
                         no_args_is_help=True, rich_markup_mode=None)
app.add_typer(bisect_app, name="bisect")


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Show tracebacks of errors.")) -> None:
    """Record-and-replay debugger for LLM inference engines that speak vLLM's v1 data contracts."""
    if verbose:
        # the environment, not a module global: processes the command starts (vLLM's) see it too
        os.environ[VERBOSE_ENV] = "1"


def verbose() -> bool:
    """Whether `-v` was given (or REPLAY_VERBOSE=1 is set)."""
    return os.environ.get(VERBOSE_ENV) == "1"


def err(msg: str) -> None:
    """One diagnostic line on stderr, prefixed with the tool's name."""
    print(f"replay: {msg}", file=sys.stderr)


def emit(result: Any, render: Callable[[Any], str], *, json: bool = False, stderr: bool = False,
         separate: bool = False) -> None:
    """Print a library result: as one JSON line, or as `render` puts it; on stdout, or as a diagnostic on stderr
    (`stderr`: where stdout carries something else, or nothing a script should parse). `separate`: a blank line
    first (the next of several results)."""
    if separate:
        print()
    if json:
        from replay.jsonable import dumps

        text = dumps(result)
    else:
        text = render(result)
    if stderr:
        err(text)
    else:
        print(text)


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with ReplayErrors turned into one stderr line and their exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ReplayError as e:
            if verbose():
                traceback.print_exc()
            err(str(e))
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err("interrupted")
            raise typer.Exit(130) from None
        except BrokenPipeError:  # `replay export x | head`
            raise typer.Exit(EXIT_OK) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as e:  # noqa: BLE001 - a bug of ours or a library's: one line, the traceback with -v
            if verbose():
                traceback.print_exc()
            msg = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            err(f"internal error, please report it: {msg}" + ("" if verbose() else " (`replay -v ...` shows where)"))
            raise typer.Exit(EXIT_USAGE) from None

    return wrapper


def command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Register a top-level command."""
    return app.command()(_guarded(fn))


def bisect_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Register `replay bisect NAME` for a function named `bisect_NAME`."""
    return bisect_app.command(fn.__name__.removeprefix("bisect_"))(_guarded(fn))


def each_capture(paths: list[Path], fn: Callable[[int, Path], None], *, json: bool = False) -> int | None:
    """`fn(i, path)` for each capture of a set (a directory, a glob, a data-parallel run's ranks): one that cannot
    be read is one line naming it (with `json`, also an object `{capture, error, exit_code}` in the stream, so a
    script sees every capture), and the others still run, so a later rank's divergence is never hidden behind an
    earlier rank's damage. Returns the exit code of the first that failed (None: none did); a single capture
    raises as it would alone."""
    failed = None
    for i, path in enumerate(paths):
        try:
            fn(i, path)
        except ReplayError as e:
            if len(paths) == 1:
                raise
            msg = str(e)
            err(msg if str(path) in msg else f"{path}: {msg}")
            if json:
                emit({"capture": str(path), "error": msg, "exit_code": e.exit_code}, str, json=True)
            failed = e.exit_code if failed is None else failed
    return failed


def damage_exit(damage: list[Damage], *, listed: bool = True) -> None:
    """Exit 3 after saying the capture is damaged; `listed=False` also names each problem (on stderr)."""
    if damage:
        if not listed:
            for d in damage:
                err(f"{d.kind}: {d.describe()}")
        what = ("capture is still being written: read what is on disk so far" if still_written(damage)
                else f"capture is damaged: {len(damage)} problem(s), data was lost")
        err(what + (" (see above)" if listed else ""))
        raise typer.Exit(EXIT_DAMAGED)


def stderr_log(msg: str) -> None:
    """Progress lines for humans, on stderr."""
    print(msg, file=sys.stderr, flush=True)


def progress_log(quiet: bool) -> Callable[[str], None]:
    """Where a long command's progress lines go: stderr, or nowhere with --quiet."""
    return (lambda msg: None) if quiet else stderr_log


def int_range(text: str, flag: str) -> tuple[int, int]:
    """`MIN:MAX` (or `N`) -> (MIN, MAX), 0 <= MIN <= MAX; anything else is a UsageError naming the flag."""
    try:
        lo, _, hi = text.partition(":")
        pair = int(lo), int(hi or lo)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected MIN:MAX (integers)") from None
    if not 0 <= pair[0] <= pair[1]:
        raise UsageError(f"{flag} {text!r}: expected 0 <= MIN <= MAX")
    return pair


def step_range(text: str | None, flag: str = "--steps") -> StepRange | None:
    """A StepRange from `--steps A-B` (None when not given)."""
    return None if text is None else StepRange.parse(text, flag)


def knobs_with_runner(set_: list[str] | None, runner: str | None) -> list[str]:
    """The --set knobs with `--runner R` as `runner=R`; a --set runner= that says otherwise is a UsageError."""
    from replay.replayer.knobs import with_runner

    return with_runner(list(set_ or []), runner, "--runner {runner} and --set runner={said}")


def replay_options(mode: str, set_: list[str] | None, steps: str | None, atol: float, rtol: float, tie_margin: float,
                   repeat: int, force: bool, plant: str | None, diff: bool = True,
                   runner: str | None = None, tolerance: str | None = None, from_start: bool = False,
                   quiet: bool = False) -> ReplayOptions:
    """ReplayOptions from the replay commands' shared flags (`--runner R` is `--set runner=R`; `--tolerance auto`
    chooses between bitwise and a cross-hardware tolerance, and cannot be mixed with --atol/--rtol; `quiet`: no
    `replayed step N` line on a terminal)."""
    from replay.replayer import Plant, ReplayOptions, parse_overrides

    tol, auto = ReplayOptions.tolerance_from(tolerance, atol, rtol, tie_margin)
    return ReplayOptions(mode=mode, overrides=parse_overrides(knobs_with_runner(set_, runner)),
                         steps=step_range(steps), tolerance=tol, auto_tolerance=auto,
                         repeat=repeat, force=force,
                         plant=Plant.parse(plant) if plant else None, diff=diff, from_start=from_start,
                         progress=step_progress if sys.stderr.isatty() and not quiet else None)


def step_progress(index: int | None) -> None:
    """`replayed step N` on one stderr line while a replay runs; the line ends with the replay (None)."""
    if index is None:
        print(file=sys.stderr)
    else:
        print(f"\rreplayed step {index}", end="", file=sys.stderr, flush=True)


CaptureArg = typer.Argument(..., help="Capture file.", show_default=False)
CaptureSetArg = typer.Argument(..., help="Capture file, or a directory or glob of them (one per data-parallel rank).",
                               show_default=False)
JsonOpt = typer.Option(False, "--json", help="Print the result as JSON on stdout.")
ModeOpt = typer.Option("forced", "--mode",
                       help="forced: recorded tokens fed back each step (local diffs); free: the runner's own.")
SetOpt = typer.Option(None, "--set",
                      help="Override a knob for the replay (repeatable): dtype, attention, threads, device, model, "
                      "seed, runner, vLLM's layout knobs, vllm.ARG=VALUE (any vLLM engine argument), env.NAME=VALUE "
                      "(an environment variable, in a fresh process).")
JobsOpt = typer.Option(1, "--jobs", "-j", min=1, help="Run N replays at once, in local processes.")
RayOpt = typer.Option(False, "--ray", help="One Ray task per replay, on the cluster at RAY_ADDRESS (or --ray-address), "
                                           "else on a local single-node one.")
RayAddressOpt = typer.Option(None, "--ray-address", help="Ray cluster to join (implies --ray).")


def fan_out_options(jobs: int, ray: bool, ray_address: str | None) -> FanOut:
    """Where independent replays run, from --jobs / --ray / --ray-address."""
    from replay.processes.fanout import FanOut

    return FanOut(jobs=jobs, ray=ray or ray_address is not None, ray_address=ray_address)


RunnerOpt = typer.Option(None, "--runner",
                         help="builtin (the reference runner) | vllm (vLLM's own model runner); same as --set "
                              "runner=...")
StepsOpt = typer.Option(None, "--steps",
                        help="Diff only steps A-B (the steps before A still run, from the nearest keyframe at or "
                             "before A, else from step 0).")
FromStartOpt = typer.Option(False, "--from-start",
                            help="Replay from step 0 (or where the capture opens) even where a keyframe stands "
                                 "nearer: no request rebuilt.")
AtolOpt = typer.Option(0.0, "--atol", min=0, help="Absolute logprob tolerance (default: bitwise).")
RtolOpt = typer.Option(0.0, "--rtol", min=0, help="Relative logprob tolerance (default: bitwise).")
ToleranceOpt = typer.Option(None, "--tolerance", help="auto: bitwise on the recording's hardware, else the "
                            "measured cross-hardware tolerance (it says which it took); bitwise: the default.")
TieOpt = typer.Option(DEFAULT_TIE_MARGIN, "--tie-margin", min=0,
                      help="A token flip at a top1-top2 margin below this is a tie flip.")
ForceOpt = typer.Option(False, "--force", help="Replay even on a model whose weights differ from the recording's.")
PlantOpt = typer.Option(None, "--plant",
                        help="Plant a divergence: STEP:REQUEST:MODULE:SIZE adds SIZE to that module's output.")
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress lines on stderr.")
StateOpt = typer.Option(None, "--state",
                        help="JSON file keeping every re-execution's result: an interrupted run resumes from it.")
