"""Commands that replay and compare: run, check, diff."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from replay.cli.common import (
    AtolOpt,
    CaptureArg,
    CaptureSetArg,
    ForceOpt,
    JsonOpt,
    ModeOpt,
    PlantOpt,
    RtolOpt,
    RunnerOpt,
    SetOpt,
    StepsOpt,
    TieOpt,
    ToleranceOpt,
    command,
    emit,
    err,
    replay_options,
)
from replay.errors import EXIT_DAMAGED


@command
def run(
    capture: Path = CaptureSetArg,
    diff: bool = typer.Option(False, "--diff", help="Diff tokens and logprobs against the recording."),
    mode: str = ModeOpt,
    set_: Optional[list[str]] = SetOpt,
    runner: Optional[str] = RunnerOpt,
    steps: Optional[str] = StepsOpt,
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    tolerance: Optional[str] = ToleranceOpt,
    tie_margin: float = TieOpt,
    repeat: int = typer.Option(1, "--repeat", min=1, help="Replay N times and report whether the runner is run-to-run deterministic."),
    force: bool = ForceOpt,
    plant: Optional[str] = PlantOpt,
    json: bool = JsonOpt,
) -> None:
    """Re-execute the recorded steps on a fresh runner; with --diff, report where and how the outputs part. A
    directory or glob replays each capture in it (one per data-parallel rank, say).

    Exit 0: matches within tolerance; 1: diverges; 2: bad input; 3: the readable prefix matches, data was lost."""
    from replay.capture import capture_paths
    from replay.cli.render_replay import render_replay, render_run
    from replay.replayer import replay_capture

    opts = replay_options(mode, set_, steps, atol, rtol, tie_margin, repeat, force, plant, diff, runner, tolerance)
    diverged = lost = False
    for i, path in enumerate(capture_paths(capture)):
        rep = replay_capture(path, opts)
        emit(rep, render_replay if diff else render_run, json=json, separate=i > 0 and not json)
        # without --diff only a recorded crash is compared: did the same exception repeat at the same step?
        diverged |= rep.diverged if diff else rep.crash is not None and not rep.crash.reproduced
        lost |= bool(rep.data_lost)  # the readable prefix replayed (and matched), but the capture lost data
    if diverged:
        raise typer.Exit(1)
    if lost:
        raise typer.Exit(EXIT_DAMAGED)


@command
def check(
    capture: Path = CaptureArg,
    mode: str = ModeOpt,
    set_: Optional[list[str]] = SetOpt,
    runner: Optional[str] = RunnerOpt,
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    tolerance: Optional[str] = ToleranceOpt,
    force: bool = ForceOpt,
) -> None:
    """Predicate for `git bisect run`: 0 replays within tolerance, 1 diverges, 125 cannot test. With
    `--tolerance auto` it says which tolerance it took: bitwise on the recording's hardware, else a measured one."""
    from replay.cli.render_replay import render_check
    from replay.replayer import check_capture

    try:
        opts = replay_options(mode, set_, None, atol, rtol, 0.05, 1, force, None, runner=runner, tolerance=tolerance)
    except Exception as e:  # even a bad flag must not read as "bad commit" to git bisect
        err(str(e))
        raise typer.Exit(125) from None
    res = check_capture(capture, opts)
    emit(res, render_check, stderr=True)
    raise typer.Exit(res.code)


@command
def diff(
    a: Path = typer.Argument(..., help="First capture (or directory / glob of them)."),
    b: Path = typer.Argument(..., help="Second capture of the same workload (or directory / glob)."),
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    tie_margin: float = TieOpt,
    json: bool = JsonOpt,
) -> None:
    """Compare two captures of the same workload request by request; exit 1 when they differ. Two directories or
    globs of captures (one per data-parallel rank) are compared pair by pair, in name order."""
    from replay.capture import capture_paths
    from replay.cli.render_replay import render_capture_diff
    from replay.diff import Tolerance, diff_captures
    from replay.errors import UsageError

    set_a, set_b = capture_paths(a), capture_paths(b)
    if len(set_a) != len(set_b):
        raise UsageError(f"{a} holds {len(set_a)} capture(s), {b} holds {len(set_b)}: sets are compared pair by pair")
    diverged = False
    for i, (x, y) in enumerate(zip(set_a, set_b)):
        res = diff_captures(x, y, Tolerance(atol, rtol, tie_margin))
        emit(res, render_capture_diff, json=json, separate=i > 0 and not json)
        diverged |= res.diverged
    if diverged:
        raise typer.Exit(1)
