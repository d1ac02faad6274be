"""The `replay bisect` subcommands: steps, batch, layers, config."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from replay.cli.common import AtolOpt, CaptureArg, JsonOpt, ModeOpt, PlantOpt, QuietOpt, RtolOpt, SetOpt, StateOpt, StepsOpt, _log, _replay_options, bisect_command


@bisect_command
def bisect_steps(
    a: Path = typer.Argument(..., help="Capture (replayed and diffed), or capture A of two."),
    b: Optional[Path] = typer.Argument(None, help="Capture B: compare two captures instead of replaying."),
    mode: str = ModeOpt,
    set_: Optional[list[str]] = SetOpt,
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    json: bool = JsonOpt,
) -> None:
    """The first step where recorded and replayed (or A and B) part. Exit 1 when they do."""
    from replay.bisect.steps import bisect_steps as run_it
    from replay.diff import Tolerance

    res = run_it(a, b, opts=_replay_options(mode, set_, None, atol, rtol, 0.05, 1, False, None), tol=Tolerance(atol, rtol))
    if json:
        from replay.jsonable import dumps

        print(dumps(res))
    else:
        from replay.render import render_capture_diff, render_replay

        print(res.verdict)
        print(render_replay(res.replay) if res.replay is not None else render_capture_diff(res.capture_diff))
    if res.step is not None:
        raise typer.Exit(1)


@bisect_command
def bisect_batch(
    capture: Path = CaptureArg,
    step: int = typer.Option(..., "--step", min=0, help="The step to re-execute."),
    request: str = typer.Option(..., "--request", help="The request to watch (external or internal id)."),
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    set_: Optional[list[str]] = SetOpt,
    state: Optional[Path] = StateOpt,
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """Which co-batched requests change REQUEST's numerics at STEP (ddmin), and does batch size alone?"""
    from replay.bisect.batch import bisect_batch as run_it
    from replay.diff import Tolerance
    from replay.runners import parse_overrides

    res = run_it(capture, step, request, tol=Tolerance(atol, rtol), overrides=parse_overrides(set_), log=_log(quiet),
                 state=state)
    if json:
        from replay.jsonable import dumps

        print(dumps(res))
        return
    print(res.verdict)
    print(f"  alone vs in its recorded batch ({len(res.neighbours)} neighbours): max |Δlogit| {res.max_abs_logit_diff:.3g}, "
          f"token {res.token_alone} alone, {res.token_in_batch} in the batch")
    print("  padding: " + ", ".join(f"+{p.padding} {'same' if p.same_as_alone else f'Δ{p.max_abs_logit_diff:.2g}'}"
                                    for p in res.padding))
    print(f"  {res.re_executions} re-executions of step {res.step}")


@bisect_command
def bisect_layers(
    capture: Path = CaptureArg,
    step: int = typer.Option(..., "--step", min=0),
    request: str = typer.Option(..., "--request"),
    against: str = typer.Option("solo", "--against", help="solo (REQUEST alone) or KNOB=VALUE,... (e.g. dtype=bfloat16)."),
    plant: Optional[str] = PlantOpt,
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """The first module whose output for REQUEST differs between two executions of STEP, and how it grows."""
    from replay.bisect.layers import bisect_layers as run_it
    from replay.plant import Plant

    res = run_it(capture, step, request, against, plant=Plant.parse(plant) if plant else None, log=_log(quiet))
    if json:
        from replay.jsonable import dumps

        print(dumps(res))
        return
    print(res.verdict)
    print(f"  {'module':<40} {'equal':>6} {'max |Δ|':>11} {'ULPs':>10}")
    for m in res.modules:
        print(f"  {m.module:<40} {'yes' if m.equal else 'NO':>6} {m.max_abs:>11.3g} {m.max_ulps:>10.3g}")


@bisect_command
def bisect_config(
    capture: Path = CaptureArg,
    good: str = typer.Option("", "--good", help="Knobs that replay within tolerance, K=V,... (default: as recorded)."),
    bad: str = typer.Option(..., "--bad", help="Knobs that diverge, K=V,..."),
    steps: Optional[str] = StepsOpt,
    state: Optional[Path] = StateOpt,
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """The minimal set of knob changes (between --good and --bad) that makes the replay diverge (ddmin)."""
    from replay.bisect.config import bisect_config as run_it

    res = run_it(capture, good, bad, steps=steps, log=_log(quiet), state=state)
    if json:
        from replay.jsonable import dumps

        print(dumps(res))
        return
    print(res.verdict)
    print(f"  {res.re_executions} replays")
