"""The `replay` command: parse, call one library function, render, map errors to exit codes (DESIGN §6).

Results go to stdout, diagnostics to stderr. Every error is one line (`replay: <file>: <problem>`), never a
traceback. Exit codes: 0 ok, 1 divergence / nothing recoverable, 2 usage or unreadable input, 3 completed on a
damaged capture, 125 cannot test.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Optional

import typer
from typer.exceptions import Abort, Exit, TyperException

from replay.errors import EXIT_DAMAGED, EXIT_OK, EXIT_USAGE, ReplayError

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


def command(fn):
    """Register a command whose ReplayErrors become one stderr line and their exit code."""

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

    return app.command()(wrapper)


def _damage_exit(damage, *, listed: bool = True) -> None:
    """Exit 3 after saying the capture is damaged; `listed=False` also names each problem (on stderr)."""
    if damage:
        if not listed:
            for d in damage:
                _err(f"{d.kind}: {d.describe()}")
        _err(f"capture is damaged: {len(damage)} problem(s), data was lost" + (" (see above)" if listed else ""))
        raise typer.Exit(EXIT_DAMAGED)


@command
def info(capture: Path = CaptureArg, json: bool = JsonOpt) -> None:
    """Header summary, steps, requests, tokens, sizes and damage of a capture."""
    from replay.summary import capture_info

    res = capture_info(capture)
    if json:
        from replay.jsonable import dumps

        print(dumps(res))
    else:
        from replay.render import render_info

        print(render_info(res))
    _damage_exit(res.damage)


@command
def show(
    capture: Path = CaptureArg,
    step: Optional[str] = typer.Option(None, "--step", "-s", help="Step N, range A-B, or A- (to the end)."),
    request: Optional[str] = typer.Option(None, "--request", "-r", help="Only steps scheduling this request (internal or external id)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="At most this many steps."),
    json: bool = JsonOpt,
) -> None:
    """One step (or a range, or one request's steps) as a human reads it."""
    from replay.show import show_steps

    res = show_steps(capture, step, request, limit)
    if json:
        from replay.jsonable import dumps

        print(dumps(res))
    else:
        from replay.render import render_shown

        print(render_shown(res))
    _damage_exit(res.damage)


@command
def recover(
    capture: Path = CaptureArg,
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Where to write (default: NAME without .partial, or NAME.recovered.capture)."),
    force: bool = typer.Option(False, "--force", help="Overwrite OUTPUT if it exists."),
    json: bool = JsonOpt,
) -> None:
    """Rewrite a damaged or unfinished capture with every readable record and a seek index.

    Exit 0: nothing was lost; 3: written, but data was lost; 1: nothing recoverable."""
    from replay.capture.recover import recover as do_recover

    res = do_recover(capture, output, force=force)
    if json:
        from replay.jsonable import dumps

        print(dumps(res))
    else:
        from replay.render import render_recover

        print(render_recover(res))
    if res.lost_data:
        raise typer.Exit(EXIT_DAMAGED)


@command
def export(
    capture: Path = CaptureArg,
    format: str = typer.Option("jsonl", "--format", "-f", help="Output format: jsonl (one JSON object per record)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write to a file instead of stdout."),
) -> None:
    """Every record of a capture, one JSON object per line, for other tools."""
    from replay.export import export_records

    if output is None:
        n, damage = export_records(capture, sys.stdout, format)
    else:
        try:
            with open(output, "w") as f:
                n, damage = export_records(capture, f, format)
        except OSError as e:
            from replay.errors import UsageError

            raise UsageError(f"{output}: cannot write: {e.strerror or e}") from None
    _err(f"exported {n} records")
    _damage_exit(damage, listed=False)


@command
def synth(
    output: Path = typer.Argument(..., help="Capture file to write."),
    steps: int = typer.Option(200, "--steps", min=1, help="Engine steps."),
    running: int = typer.Option(64, "--running", min=1, help="Concurrently running requests."),
    logprobs: int = typer.Option(5, "--logprobs", min=-1, help="Top-k logprobs per token; -1 for none."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic workload."),
    force: bool = typer.Option(False, "--force", help="Overwrite OUTPUT if it exists."),
) -> None:
    """Record a synthetic capture (realistic shapes, no model): for trying the tools and testing the format."""
    from replay.synthetic import Workload, record_synthetic

    path = record_synthetic(output, Workload(steps=steps, running=running, num_logprobs=None if logprobs < 0 else logprobs,
                                             seed=seed), overwrite=force)
    print(f"wrote {path}")


@command
def demo(
    output: Path = typer.Option(Path("captures/demo.capture"), "--output", "-o", help="Where to write the demo capture."),
) -> None:
    """The main job on the embedded default: record a capture, then inspect it."""
    from replay.render import render_info
    from replay.summary import capture_info
    from replay.synthetic import Workload, record_synthetic

    path = record_synthetic(output, Workload(steps=300, running=64, seed=0), overwrite=True)
    print(f"recorded {path}\n")
    print(render_info(capture_info(path)))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `replay` console script. Returns the exit code."""
    try:
        rc = app(args=argv, prog_name="replay", standalone_mode=False)
    except Exit as e:
        return e.exit_code
    except Abort:
        _err("aborted")
        return 130
    except TyperException as e:  # typer's (vendored click) usage errors: one line, exit 2
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `replay` or `replay CMD`: show the help
            print(e.format_message(), file=sys.stderr)
        else:
            _err(e.format_message() if hasattr(e, "format_message") else str(e))
        return getattr(e, "exit_code", EXIT_USAGE) or EXIT_USAGE
    return rc if isinstance(rc, int) else EXIT_OK


def run() -> None:
    """Console-script wrapper: exit with `main()`'s code."""
    sys.exit(main())


if __name__ == "__main__":
    run()
