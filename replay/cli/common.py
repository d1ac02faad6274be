"""Shared pieces of the command line: the typer apps, error handling, rendering, common options."""

from __future__ import annotations

import functools
import sys

import typer

from replay.errors import EXIT_DAMAGED, EXIT_OK, ReplayError


app = typer.Typer(
    name="replay",
    help="Record-and-replay debugger for LLM inference engines that speak vLLM's v1 data contracts.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


CaptureArg = typer.Argument(..., help="Capture file.", show_default=False)


JsonOpt = typer.Option(False, "--json", help="Print the result as JSON on stdout.")


def _err(msg: str) -> None:
    print(f"replay: {msg}", file=sys.stderr)


def _guarded(fn):
    """`fn` with ReplayErrors turned into one stderr line and their exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ReplayError as e:
            _err(str(e))
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            _err("interrupted")
            raise typer.Exit(130) from None
        except BrokenPipeError:  # `replay export x | head`
            raise typer.Exit(EXIT_OK) from None

    return wrapper


def command(fn):
    """Register a top-level command."""
    return app.command()(_guarded(fn))


def _damage_exit(damage, *, listed: bool = True) -> None:
    """Exit 3 after saying the capture is damaged; `listed=False` also names each problem (on stderr)."""
    if damage:
        if not listed:
            for d in damage:
                _err(f"{d.kind}: {d.describe()}")
        _err(f"capture is damaged: {len(damage)} problem(s), data was lost" + (" (see above)" if listed else ""))
        raise typer.Exit(EXIT_DAMAGED)


def _emit(result, json: bool, render: str) -> None:
    """Print a library result: as JSON, or through `replay.render.<render>` (imported only when needed)."""
    if json:
        from replay.jsonable import dumps

        print(dumps(result))
    else:
        from replay import render as r

        print(getattr(r, render)(result))


def _replay_options(mode, set_, steps, atol, rtol, tie_margin, repeat, force, plant, diff=True):
    from replay.diff import Tolerance
    from replay.plant import Plant
    from replay.replayer import ReplayOptions
    from replay.runners import parse_overrides

    return ReplayOptions(mode=mode, overrides=parse_overrides(set_), steps=steps,
                         tolerance=Tolerance(atol, rtol, tie_margin), repeat=repeat, force=force,
                         plant=Plant.parse(plant) if plant else None, diff=diff, progress=sys.stderr.isatty())


ModeOpt = typer.Option("forced", "--mode", help="forced: recorded tokens fed back each step (local diffs); free: the runner's own.")


SetOpt = typer.Option(None, "--set", help="Override a knob for the replay: dtype, attention, threads, device, model, seed, runner (repeatable).")


RunnerOpt = typer.Option(None, "--runner", help="builtin (the reference runner) | vllm (vLLM's own model runner); same as --set runner=...")


def _with_runner(set_: list[str] | None, runner: str | None) -> list[str] | None:
    """--runner R as the `runner` knob."""
    return set_ if runner is None else [*(set_ or []), f"runner={runner}"]


StepsOpt = typer.Option(None, "--steps", help="Diff only steps A-B (steps before A still run: state is rebuilt from step 0).")


AtolOpt = typer.Option(0.0, "--atol", min=0, help="Absolute logprob tolerance (default: bitwise).")


RtolOpt = typer.Option(0.0, "--rtol", min=0, help="Relative logprob tolerance (default: bitwise).")


TieOpt = typer.Option(0.05, "--tie-margin", min=0, help="A token flip at a top1-top2 margin below this is a tie flip.")


ForceOpt = typer.Option(False, "--force", help="Replay even on a model whose weights differ from the recording's.")


PlantOpt = typer.Option(None, "--plant", help="Plant a divergence: STEP:REQUEST:MODULE:SIZE adds SIZE to that module's output.")


bisect_app = typer.Typer(help="Narrow a divergence down: to a step, a co-batched request, a module, a knob.",
                         no_args_is_help=True, rich_markup_mode=None)
app.add_typer(bisect_app, name="bisect")


def bisect_command(fn):
    """Register `replay bisect NAME` for a function named `bisect_NAME`."""
    return bisect_app.command(fn.__name__.removeprefix("bisect_"))(_guarded(fn))


def _log(quiet: bool):
    from replay.bisect.session import stderr_log

    return (lambda msg: None) if quiet else stderr_log


QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress lines on stderr.")


StateOpt = typer.Option(None, "--state", help="JSON file keeping every re-execution's result: an interrupted run resumes from it.")


def _range(text: str, flag: str) -> tuple[int, int]:
    from replay.errors import UsageError

    try:
        lo, _, hi = text.partition(":")
        return int(lo), int(hi or lo)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected MIN:MAX (integers)") from None
