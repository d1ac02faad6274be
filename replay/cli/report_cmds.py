"""`replay report`: one self-contained HTML file that shows a run and, when asked, a comparison."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.common import (
    AtolOpt,
    CaptureArg,
    ForceOpt,
    JsonOpt,
    ModeOpt,
    QuietOpt,
    RtolOpt,
    RunnerOpt,
    SetOpt,
    TieOpt,
    ToleranceOpt,
    command,
    emit,
    replay_options,
)
from replay.errors import EXIT_DAMAGED, UsageError


@command
def report(
    capture: Path = CaptureArg,
    other: Path | None = typer.Argument(None, help="A second capture of the same workload: report how the two "
                                           "runs differ (as `replay diff A B`).", show_default=False),
    output: Path | None = typer.Option(None, "--output", "-o", help="The HTML file to write (default: "
                                          "NAME.report.html beside the capture)."),
    diff: bool = typer.Option(False, "--diff", help="Replay the capture and report where the replay diverges (as "
                              "`replay run --diff`)."),
    mode: str = ModeOpt,
    set_: list[str] | None = SetOpt,
    runner: str | None = RunnerOpt,
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    tolerance: str | None = ToleranceOpt,
    tie_margin: float = TieOpt,
    force: bool = ForceOpt,
    bisect: Path | None = typer.Option(None, "--bisect", help="Show a bisect's verdict too: the JSON that "
                                          "`replay bisect ... --json` printed."),
    explain: Path | None = typer.Option(None, "--explain", help="Show `replay explain`'s class and evidence too: "
                                           "the JSON that `replay explain ... --json` printed."),
    trainer: Path | None = typer.Option(None, "--trainer", help="Show `replay trainer`'s figures too (a histogram "
                                           "of |Δ|, |Δ| by position): the JSON that `replay trainer --json` printed."),
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """Write one self-contained HTML file (no network; opens from disk) showing the run: provenance, requests, a
    step timeline. With --diff (and --set, --runner, tolerances) or a second capture it leads with the verdict the
    terminal prints and shows where and how the runs part: a steps x requests heat map of |Δlogprob|, the first
    divergence and token flip, |Δlogprob| against the top1-top2 margin, the batch, a sortable request table.

    CAPTURE may also be the results file of `replay check CORPUS --results FILE`: the page of that corpus check.

    Exit 0: written (no divergence); 1: written, the comparison diverges; 2: bad input; 3: the capture is damaged."""
    from replay.diff import Tolerance
    from replay.report import write_report
    from replay.report.corpus import (
        is_results_file,
        read_results_file,
        write_corpus_report,
    )

    if is_results_file(capture):
        if other is not None or diff:
            raise UsageError(f"{capture} is a corpus check's results file: it reports as it is (no --diff, no OTHER)")
        page = write_corpus_report(read_results_file(capture), output or capture.with_suffix(".html"))
        emit(page, lambda r: f"wrote {r.path} ({r.bytes / 1e3:,.0f} kB)\n{r.summary}", json=json)
        raise typer.Exit(1 if page.bad else 0)

    replaying = [flag for flag, given in (("--set", set_), ("--runner", runner), ("--tolerance", tolerance),
                                          ("--mode", mode != "forced"), ("--force", force)) if given]
    if other is not None and (diff or replaying):
        raise UsageError(f"{(replaying or ['--diff'])[0]} replays CAPTURE; a report of two captures compares them "
                         "as recorded (drop it, or OTHER)")
    if not diff and replaying:
        raise UsageError(f"{replaying[0]} is an option of the replay: add --diff")
    if other is None and not diff and (atol or rtol):
        raise UsageError("--atol/--rtol set how a comparison judges logprobs: add --diff, or a second capture")
    opts = replay_options(mode, set_, None, atol, rtol, tie_margin, 1, force, None, runner=runner,
                          tolerance=tolerance, quiet=quiet) if diff else None
    res = write_report(capture, output, replay=opts, other=other, bisect=bisect, explain=explain, trainer=trainer,
                       tolerance=Tolerance(atol, rtol, tie_margin) if other is not None else None)
    emit(res, lambda r: f"wrote {r.path} ({r.bytes / 1e3:,.0f} kB in {r.seconds:.1f} s)\n{r.verdict}", json=json)
    if res.diverged:
        raise typer.Exit(1)
    if res.data_lost:
        raise typer.Exit(EXIT_DAMAGED)
