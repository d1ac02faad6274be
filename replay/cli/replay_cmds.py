"""Commands that replay and compare: run, check, diff."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from replay.cli.common import (
    AtolOpt,
    CaptureSetArg,
    ForceOpt,
    FromStartOpt,
    JobsOpt,
    JsonOpt,
    ModeOpt,
    PlantOpt,
    QuietOpt,
    RayAddressOpt,
    RayOpt,
    RtolOpt,
    RunnerOpt,
    SetOpt,
    StepsOpt,
    TieOpt,
    ToleranceOpt,
    command,
    each_capture,
    emit,
    err,
    fan_out_options,
    replay_options,
)
from replay.diff.rules import DEFAULT_TIE_MARGIN
from replay.errors import EXIT_DAMAGED, ReplayError, UsageError


@command
def run(
    capture: Path = CaptureSetArg,
    diff: bool = typer.Option(False, "--diff", help="Diff tokens and logprobs against the recording."),
    mode: str = ModeOpt,
    set_: list[str] | None = SetOpt,
    runner: str | None = RunnerOpt,
    steps: str | None = StepsOpt,
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    tolerance: str | None = ToleranceOpt,
    tie_margin: float = TieOpt,
    repeat: int = typer.Option(1, "--repeat", min=1,
                               help="Replay N times and report whether the runner is run-to-run deterministic."),
    from_keyframe: bool = typer.Option(False, "--from-keyframe",
                                       help="With --steps A-B: start at the keyframe nearest before A (its live "
                                            "requests rebuilt, and compared as such); the default with --steps."),
    from_start: bool = FromStartOpt,
    force: bool = ForceOpt,
    plant: str | None = PlantOpt,
    jobs: int = JobsOpt,
    ray: bool = RayOpt,
    ray_address: str | None = RayAddressOpt,
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """Re-execute the recorded steps on a fresh runner; with --diff, report where and how the outputs part. A
    directory or glob replays each capture in it (one per data-parallel rank, say).

    With --repeat, --jobs or --ray runs the 2nd..Nth replays in other processes (or Ray workers).

    Exit 0: matches within tolerance; 1: diverges; 2: bad input; 3: the readable prefix matches, data was lost."""
    import dataclasses

    from replay.capture import capture_paths
    from replay.cli.render_replay import render_replay, render_run
    from replay.replayer import replay_capture

    if from_keyframe and from_start:
        raise UsageError("--from-keyframe and --from-start: pick one")
    opts = replay_options(mode, set_, steps, atol, rtol, tie_margin, repeat, force, plant, diff, runner, tolerance,
                          from_start, quiet)
    opts = dataclasses.replace(opts, fan_out=fan_out_options(jobs, ray, ray_address), from_keyframe=from_keyframe)
    diverged = lost = False

    def one(i: int, path: Path) -> None:
        nonlocal diverged, lost
        rep = replay_capture(path, opts)
        emit(rep, render_replay if diff else render_run, json=json, separate=i > 0 and not json)
        # without --diff only a recorded crash is compared: did the same exception repeat at the same step?
        diverged |= rep.diverged if diff else rep.crash is not None and not rep.crash.reproduced
        lost |= bool(rep.data_lost)  # the readable prefix replayed (and matched), but the capture lost data

    failed = each_capture(capture_paths(capture), one, json=json)
    if diverged:  # what the replays found comes first; a capture that could not be read said so in its line
        raise typer.Exit(1)
    if failed is not None:
        raise typer.Exit(failed)
    if lost:
        raise typer.Exit(EXIT_DAMAGED)


@command
def check(
    capture: Path = typer.Argument(..., help="Capture file; or a corpus: a directory, a glob or a list file of them.",
                                   show_default=False),
    mode: str = ModeOpt,
    set_: list[str] | None = SetOpt,
    runner: str | None = RunnerOpt,
    steps: str | None = StepsOpt,
    from_start: bool = FromStartOpt,
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    tolerance: str | None = ToleranceOpt,
    force: bool = ForceOpt,
    jobs: int = JobsOpt,
    ray: bool = RayOpt,
    ray_address: str | None = RayAddressOpt,
    results: Path | None = typer.Option(None, "--results", help="Corpus: append each row to this JSONL file as "
                                           "it finishes; rows already there for unchanged captures are reused."),
    report: Path | None = typer.Option(None, "--report", help="Corpus: also write the answer as one HTML page "
                                          "(`replay report RESULTS` writes it from a results file later)."),
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """Predicate for `git bisect run`: 0 replays within tolerance, 1 diverges, 125 cannot test. With
    `--tolerance auto` it says which tolerance it took: bitwise on the recording's hardware, else a measured one.
    Given a corpus (a directory, glob or list file), it checks every capture and prints one row each and a summary:
    1 if any diverges, 0 if none does, 125 if none could be tested."""
    from replay.cli.render_replay import render_check, render_corpus, render_corpus_row
    from replay.replayer import check_capture
    from replay.replayer.corpus import check_corpus, corpus_paths

    try:
        opts = replay_options(mode, set_, steps, atol, rtol, DEFAULT_TIE_MARGIN, 1, force, None, runner=runner,
                              tolerance=tolerance, from_start=from_start, quiet=quiet)
        many = corpus_paths(capture) != [capture]  # a directory, a glob, a list file
    except Exception as e:  # noqa: BLE001 - even a bad flag must not read as "bad commit" to git bisect
        err(str(e))
        raise typer.Exit(125) from None
    if not many and not (ray or ray_address or results or report or jobs > 1):
        res = check_capture(capture, opts)
        emit(res, render_check, json=json, stderr=not json)
        raise typer.Exit(res.code)
    how = fan_out_options(jobs, ray, ray_address)
    show = None if json or quiet or not sys.stderr.isatty() else (
        lambda row: print(render_corpus_row(row), file=sys.stderr))
    try:
        res = check_corpus(capture, opts, how=how, results=results, on_row=show)
    except ReplayError as e:  # a corpus that names nothing, a cluster out of reach: cannot test
        err(str(e))
        raise typer.Exit(125) from None
    except KeyboardInterrupt:  # the rows done are in the results file: say how to go on from them
        err(f"interrupted: the captures checked are in {results}; the same command resumes from there"
            if results is not None else "interrupted (--results FILE keeps each row, and resumes from them)")
        raise typer.Exit(130) from None
    emit(res, render_corpus, json=json)
    if report is not None:
        from replay.report.corpus import write_corpus_report

        page = write_corpus_report(res, report)
        err(f"wrote {page.path} ({page.bytes / 1e3:,.0f} kB)")
    if res.code == 125:  # nothing was tested: say why in one line (git bisect skips this commit)
        err(f"{capture}: none of its {len(res.rows)} capture(s) could be tested (first: {res.rows[0].reason})")
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
    globs of captures (one per data-parallel rank) are compared pair by pair, in name order.

    Exit 0: the same within tolerance; 1: they differ; 2: bad input; 3: the readable prefixes match, data was
    lost."""
    from replay.capture import capture_paths
    from replay.cli.render_replay import render_capture_diff
    from replay.diff import Tolerance, diff_captures
    from replay.errors import UsageError

    set_a, set_b = capture_paths(a), capture_paths(b)
    if len(set_a) != len(set_b):
        raise UsageError(f"{a} holds {len(set_a)} capture(s), {b} holds {len(set_b)}: sets are compared pair by pair")
    diverged = lost = False
    for i, (x, y) in enumerate(zip(set_a, set_b)):
        res = diff_captures(x, y, Tolerance(atol, rtol, tie_margin))
        emit(res, render_capture_diff, json=json, separate=i > 0 and not json)
        diverged |= res.diverged
        lost |= bool(res.data_lost)
    if diverged:
        raise typer.Exit(1)
    if lost:
        raise typer.Exit(EXIT_DAMAGED)
