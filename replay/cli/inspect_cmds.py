"""Commands that read captures: info, show, recover, export; and synth (synthetic captures)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from replay.cli.common import (
    CaptureArg,
    CaptureSetArg,
    JsonOpt,
    command,
    damage_exit,
    each_capture,
    emit,
    step_range,
)
from replay.errors import EXIT_DAMAGED


@command
def info(capture: Path = CaptureSetArg, json: bool = JsonOpt) -> None:
    """Header summary, steps, requests, tokens, sizes, how it ended and damage of a capture (or of each capture of a
    directory or glob: one per data-parallel rank, say). A ring's directory: its window, segments and snapshots."""
    from replay.capture import capture_paths
    from replay.capture.flight.ring_info import is_ring, ring_info
    from replay.cli.render_capture import render_info, render_ring
    from replay.inspect import capture_info

    if is_ring(capture):
        emit(ring_info(capture), render_ring, json=json)
        return

    damage = []

    def one(i: int, path: Path) -> None:
        res = capture_info(path)
        emit(res, render_info, json=json, separate=i > 0 and not json)
        damage.extend(res.damage)

    failed = each_capture(capture_paths(capture), one, json=json)
    damage_exit(damage)
    if failed is not None:
        raise typer.Exit(failed)


@command
def show(
    capture: Path = CaptureArg,
    step: str | None = typer.Option(None, "--step", "-s", help="Step N, range A-B, or A- (to the end)."),
    request: str | None = typer.Option(None, "--request", "-r",
                                       help="Only steps scheduling this request (internal or external id)."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="At most this many steps."),
    json: bool = JsonOpt,
) -> None:
    """One step (or a range, or one request's steps) as a human reads it."""
    from replay.cli.render_capture import render_shown
    from replay.inspect import show_steps

    res = show_steps(capture, step_range(step, "--step"), request, limit)
    emit(res, render_shown, json=json)
    damage_exit(res.damage)


@command
def recover(
    capture: Path = CaptureArg,
    output: Path | None = typer.Option(None, "--output", "-o",
                                       help="Where to write (default: NAME without .partial, or "
                                            "NAME.recovered.capture)."),
    force: bool = typer.Option(False, "--force", help="Overwrite OUTPUT if it exists."),
    json: bool = JsonOpt,
) -> None:
    """Rewrite a damaged or unfinished capture with every readable record and a seek index.

    Exit 0: nothing was lost; 3: written, but data was lost; 1: nothing recoverable."""
    from replay.capture.reading.recover import recover as do_recover
    from replay.cli.render_capture import render_recover

    res = do_recover(capture, output, force=force)
    emit(res, render_recover, json=json)
    if res.lost_data:
        raise typer.Exit(EXIT_DAMAGED)


@command
def export(
    capture: Path = CaptureArg,
    format: str = typer.Option("jsonl", "--format", "-f", help="Output format: jsonl (one JSON object per record) "
                               "or perfetto (a trace-event JSON timeline for ui.perfetto.dev and chrome://tracing)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write to a file instead of stdout."),
) -> None:
    """Every record of a capture, one JSON object per line, for other tools; or (--format perfetto) its steps and
    requests as a timeline to open in ui.perfetto.dev or chrome://tracing."""
    from functools import partial

    from replay.cli.render_capture import render_exported
    from replay.inspect import export_records

    if output is None:
        n, damage = export_records(capture, sys.stdout, format)
    else:
        try:
            with open(output, "w") as f:
                n, damage = export_records(capture, f, format)
        except OSError as e:
            from replay.errors import UsageError

            raise UsageError(f"{output}: cannot write: {e.strerror or e}") from None
    emit(n, partial(render_exported, fmt=format), stderr=True)
    damage_exit(damage, listed=False)


@command
def synth(
    output: Path = typer.Argument(..., help="Capture file to write."),
    steps: int = typer.Option(200, "--steps", min=1, help="Engine steps."),
    running: int = typer.Option(64, "--running", min=1, help="Concurrently running requests."),
    logprobs: int = typer.Option(5, "--logprobs", min=-1, help="Top-k logprobs per token; -1 for none."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic stream."),
    force: bool = typer.Option(False, "--force", help="Overwrite OUTPUT if it exists."),
) -> None:
    """Record a synthetic capture (realistic shapes, no model): for trying the tools and testing the format."""
    from replay.cli.render_capture import render_written
    from replay.record.synth import SynthShape, record_synth

    shape = SynthShape(steps=steps, running=running, num_logprobs=None if logprobs < 0 else logprobs, seed=seed)
    emit(record_synth(output, shape, overwrite=force), render_written)
