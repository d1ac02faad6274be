"""Commands that replay and compare: run, check, diff."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from replay.cli.common import (
    AtolOpt,
    CaptureArg,
    ForceOpt,
    JsonOpt,
    ModeOpt,
    PlantOpt,
    RtolOpt,
    RunnerOpt,
    SetOpt,
    StepsOpt,
    TieOpt,
    command,
    emit,
    err,
    replay_options,
)
from replay.errors import EXIT_DAMAGED


@command
def run(
    capture: Path = CaptureArg,
    diff: bool = typer.Option(False, "--diff", help="Diff tokens and logprobs against the recording."),
    mode: str = ModeOpt,
    set_: Optional[list[str]] = SetOpt,
    runner: Optional[str] = RunnerOpt,
    steps: Optional[str] = StepsOpt,
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    tie_margin: float = TieOpt,
    repeat: int = typer.Option(1, "--repeat", min=1, help="Replay N times and report whether the runner is run-to-run deterministic."),
    force: bool = ForceOpt,
    plant: Optional[str] = PlantOpt,
    json: bool = JsonOpt,
) -> None:
    """Re-execute the recorded steps on a fresh runner; with --diff, report where and how the outputs part.

    Exit 0: matches within tolerance; 1: diverges; 2: bad input."""
    from replay.cli.render_replay import render_replay, render_run
    from replay.replayer import replay_capture

    rep = replay_capture(capture, replay_options(mode, set_, steps, atol, rtol, tie_margin, repeat, force, plant,
                                                 diff, runner))
    emit(rep, render_replay if diff else render_run, json=json)
    if diff and rep.diverged:
        raise typer.Exit(1)
    if rep.data_lost:  # the readable prefix replayed (and matched), but the capture lost data
        raise typer.Exit(EXIT_DAMAGED)


@command
def check(
    capture: Path = CaptureArg,
    mode: str = ModeOpt,
    set_: Optional[list[str]] = SetOpt,
    runner: Optional[str] = RunnerOpt,
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    force: bool = ForceOpt,
) -> None:
    """Predicate for `git bisect run`: 0 replays within tolerance, 1 diverges, 125 cannot test."""
    from replay.cli.render_replay import render_check
    from replay.replayer import check_capture

    try:
        opts = replay_options(mode, set_, None, atol, rtol, 0.05, 1, force, None, runner=runner)
    except Exception as e:  # even a bad flag must not read as "bad commit" to git bisect
        err(str(e))
        raise typer.Exit(125) from None
    res = check_capture(capture, opts)
    emit(res, render_check, stderr=True)
    raise typer.Exit(res.code)


@command
def diff(
    a: Path = typer.Argument(..., help="First capture."),
    b: Path = typer.Argument(..., help="Second capture of the same workload."),
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    tie_margin: float = TieOpt,
    json: bool = JsonOpt,
) -> None:
    """Compare two captures of the same workload request by request; exit 1 when they differ."""
    from replay.cli.render_replay import render_capture_diff
    from replay.diff import Tolerance, diff_captures

    res = diff_captures(a, b, Tolerance(atol, rtol, tie_margin))
    emit(res, render_capture_diff, json=json)
    if res.diverged:
        raise typer.Exit(1)
