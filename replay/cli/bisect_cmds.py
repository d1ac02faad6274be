"""The `replay bisect` subcommands (steps, batch, leak, layers, config) and `replay explain`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from replay.cli.common import (
    AtolOpt,
    CaptureArg,
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
    StateOpt,
    StepsOpt,
    ToleranceOpt,
    bisect_command,
    command,
    emit,
    fan_out_options,
    knobs_with_runner,
    progress_log,
    replay_options,
    step_range,
)
from replay.diff.rules import DEFAULT_TIE_MARGIN
from replay.errors import EXIT_DAMAGED


@bisect_command
def bisect_steps(
    a: Path = typer.Argument(..., help="Capture (replayed and diffed), or capture A of two."),
    b: Path | None = typer.Argument(None, help="Capture B: compare two captures instead of replaying."),
    mode: str = ModeOpt,
    set_: list[str] | None = SetOpt,
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """The first step where recorded and replayed (or A and B) part. Exit 1 when they do."""
    from replay.bisect.steps import bisect_steps as run_it
    from replay.cli.render_replay import render_bisect_steps

    opts = replay_options(mode, set_, None, atol, rtol, DEFAULT_TIE_MARGIN, 1, False, None, quiet=quiet)
    res = run_it(a, b, opts=opts, tol=opts.tolerance)
    emit(res, render_bisect_steps, json=json)
    if res.step is not None:
        raise typer.Exit(1)
    lost = res.replay.data_lost if res.replay is not None else res.capture_diff.data_lost if res.capture_diff else []
    if lost:  # no divergence in the readable prefix (or prefixes), but data was lost
        raise typer.Exit(EXIT_DAMAGED)


@bisect_command
def bisect_batch(
    capture: Path = CaptureArg,
    step: int = typer.Option(..., "--step", min=0, help="The step to re-execute."),
    request: str = typer.Option(..., "--request", help="The request to watch (external or internal id)."),
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    set_: list[str] | None = SetOpt,
    runner: str | None = RunnerOpt,
    state: Path | None = StateOpt,
    from_start: bool = FromStartOpt,
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """Which co-batched requests change REQUEST's numerics at STEP (ddmin), and does batch size alone? With
    --runner vllm, on vLLM's own kernels (each test replays up to STEP, from the nearest keyframe)."""
    from replay.bisect.batch import bisect_batch as run_it
    from replay.cli.render_replay import render_bisect_batch
    from replay.diff import Tolerance
    from replay.replayer import parse_overrides

    knobs = knobs_with_runner(set_, runner)
    res = run_it(capture, step, request, tol=Tolerance(atol, rtol), overrides=parse_overrides(knobs),
                 log=progress_log(quiet), state=state, from_start=from_start)
    emit(res, render_bisect_batch, json=json)


@bisect_command
def bisect_leak(
    capture: Path = CaptureArg,
    step: int = typer.Option(..., "--step", min=0, help="The step to re-execute."),
    request: str = typer.Option(..., "--request", help="The request to watch (external or internal id)."),
    contents: str = typer.Option("random,shuffled,repeated", "--contents",
                                 help="The other contents tried, in order: random ids, each neighbour's own ids "
                                      "shuffled, one id throughout."),
    plant: str | None = PlantOpt,
    set_: list[str] | None = SetOpt,
    runner: str | None = RunnerOpt,
    from_start: bool = FromStartOpt,
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """Does REQUEST read anything of its neighbours' content? Every neighbour replayed with other tokens of the same
    shapes; REQUEST's logits at STEP must stay bitwise the same. Exit 1 on contamination, naming the neighbour and
    the first module, 0 when nothing moves, 125 when it cannot test."""
    from replay.bisect.leak import bisect_leak as run_it
    from replay.cli.render_replay import render_bisect_leak
    from replay.replayer import Plant, parse_overrides

    knobs = knobs_with_runner(set_, runner)
    res = run_it(capture, step, request, contents=tuple(c.strip() for c in contents.split(",") if c.strip()),
                 overrides=parse_overrides(knobs), plant=Plant.parse(plant) if plant else None,
                 log=progress_log(quiet), from_start=from_start)
    emit(res, render_bisect_leak, json=json)
    if res.contaminated:
        raise typer.Exit(1)


@bisect_command
def bisect_layers(
    capture: Path = CaptureArg,
    step: int = typer.Option(..., "--step", min=0),
    request: str = typer.Option(..., "--request"),
    against: str = typer.Option("solo", "--against",
                                help="solo (REQUEST alone), same, or KNOB=VALUE,... for side B (dtype=bfloat16, "
                                     "tensor_parallel_size=1, vllm.ARG=V, env.NAME=V)."),
    plant: str | None = PlantOpt,
    runner: str | None = typer.Option(None, "--runner",
                                      help="builtin (our modules, the default) | vllm (vLLM's own model and kernels, "
                                           "in every worker)."),
    set_: list[str] | None = SetOpt,
    dump: Path | None = typer.Option(None, "--dump",
                                     help="Write both sides' outputs of the first differing modules (and those just "
                                          "before) as safetensors, with index.json."),
    dump_all: bool = typer.Option(False, "--dump-all",
                                  help="With --dump: every module's output (for `bisect dumps` across two installs)."),
    from_start: bool = FromStartOpt,
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """The first module whose output for REQUEST differs between two executions of STEP, and how it grows. --set
    knobs apply to both sides, --against only to side B."""
    from replay.bisect.layers import bisect_layers as run_it
    from replay.cli.render_replay import render_bisect_layers
    from replay.replayer import Plant, parse_overrides

    overrides = parse_overrides(knobs_with_runner(set_, runner))
    res = run_it(capture, step, request, against, plant=Plant.parse(plant) if plant else None,
                 overrides=overrides, dump=dump, dump_all=dump_all, log=progress_log(quiet), from_start=from_start)
    emit(res, render_bisect_layers, json=json)


@bisect_command
def bisect_dumps(
    a: Path = typer.Argument(..., help="A dump of `bisect layers --dump-all` (say, made with the old vLLM or torch)."),
    b: Path = typer.Argument(..., help="The same step and request dumped in the other install."),
    json: bool = JsonOpt,
) -> None:
    """The first module whose output differs between two dumps of one step made in two installs (two vLLM or torch
    versions cannot share a process), and how the difference grows."""
    from replay.bisect.dump import compare_dumps
    from replay.cli.render_replay import render_bisect_layers

    emit(compare_dumps(a, b), render_bisect_layers, json=json)


@bisect_command
def bisect_config(
    capture: Path = CaptureArg,
    good: str = typer.Option("", "--good", help="Knobs that replay within tolerance, K=V,... (default: as recorded)."),
    bad: str = typer.Option(..., "--bad", help="Knobs that diverge, K=V,..."),
    steps: str | None = StepsOpt,
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    state: Path | None = StateOpt,
    jobs: int = JobsOpt,
    ray: bool = RayOpt,
    ray_address: str | None = RayAddressOpt,
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """The minimal set of knob changes (between --good and --bad) that makes the replay diverge (ddmin): bitwise,
    or beyond --atol/--rtol. With --jobs or --ray each round of ddmin's subsets replays at once; the verdict is the
    serial one."""
    from replay.bisect.config import bisect_config as run_it
    from replay.cli.render_replay import render_bisect_config
    from replay.diff import Tolerance
    from replay.integrations.vllm.engines import Engines

    with Engines() as engines:  # on vLLM's runner: one engine per configuration tested, kept for its next test
        res = run_it(capture, good, bad, steps=step_range(steps), log=progress_log(quiet), state=state,
                     how=fan_out_options(jobs, ray, ray_address), engines=engines, tolerance=Tolerance(atol, rtol))
    emit(res, render_bisect_config, json=json)


@command
def explain(
    capture: Path = CaptureArg,
    pair: tuple[str, str] | None = typer.Option(None, "--pair", help="Two requests with the same prompt and "
                                                "sampling that answered differently."),
    pairs: bool = typer.Option(False, "--pairs", help="List every such group, and explain the first."),
    step: int | None = typer.Option(None, "--step", min=0, help="The replay divergence at this step (default: the "
                                                                "first)."),
    request: str | None = typer.Option(None, "--request", help="... of this request."),
    plant: str | None = PlantOpt,
    set_: list[str] | None = SetOpt,
    runner: str | None = RunnerOpt,
    tolerance: str | None = ToleranceOpt,
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    from_start: bool = FromStartOpt,
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """Bug or noise? Why the replay parts from the recording (the first divergence, or --step/--request), or why two
    requests with the same prompt and sampling answered differently (--pair, --pairs): RUN-TO-RUN, NOT-ARGMAX,
    SAMPLER, CONFIG, CONTAMINATION, BATCH VARIANCE or RECORDING NOT REPEATABLE, with the evidence and a command.
    Exit 1 for a bug, 0 for expected numerics or nothing to explain, 3 when that holds of a damaged capture's
    readable prefix, 125 when it cannot test."""
    from replay.bisect.explain_divergence import explain_divergence
    from replay.bisect.explain_pair import explain_pair
    from replay.cli.render_explain import render_divergence, render_pair, render_twins
    from replay.diff.twins import twins_compared
    from replay.errors import UsageError

    if pair is not None and pairs:
        raise UsageError("explain: --pair A B or --pairs, not both")
    if (pair is not None or pairs) and (step is not None or request is not None):
        raise UsageError("explain: --step/--request pick a replay divergence; --pair and --pairs explain twins")
    from replay.integrations.vllm.engines import Engines

    opts = replay_options("forced", set_, None, atol, rtol, DEFAULT_TIE_MARGIN, 1, False, plant, runner=runner,
                          tolerance=tolerance, from_start=from_start, quiet=quiet)
    if pair is None and not pairs:
        with Engines() as engines:  # on vLLM's runner every test of it, one engine per configuration
            res = explain_divergence(capture, dataclasses.replace(opts, engines=engines), step=step,
                                     request=request, log=progress_log(quiet))
        emit(res, render_divergence, json=json)
        if res.bug:
            raise typer.Exit(1)
        if res.data_lost:
            raise typer.Exit(EXIT_DAMAGED)
        return
    groups = compared = None
    if pair is None:
        compared, groups = twins_compared(capture)
        if not json:
            print(render_twins(groups, compared))
        if not groups:
            if json:  # (the same shape as with groups: every group, how many compared, the first one's explanation)
                emit({"groups": groups, "compared": compared, "explanation": None}, render_twins, json=True)
            return
        pair = tuple(groups[0].pair or groups[0].requests[:2])
    res = explain_pair(capture, *pair, overrides=opts.overrides, plant=opts.plant, log=progress_log(quiet),
                       from_start=from_start)
    if json and groups is not None:
        emit({"groups": groups, "compared": compared, "explanation": res}, render_pair, json=True)
    else:
        emit(res, render_pair, json=json)
    if res.bug:
        raise typer.Exit(1)
