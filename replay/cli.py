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


@command
def info(capture: Path = CaptureArg, json: bool = JsonOpt) -> None:
    """Header summary, steps, requests, tokens, sizes and damage of a capture."""
    from replay.summary import capture_info

    res = capture_info(capture)
    _emit(res, json, "render_info")
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
    _emit(res, json, "render_shown")
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
    _emit(res, json, "render_recover")
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


def _replay_options(mode, set_, steps, atol, rtol, tie_margin, repeat, force, plant, diff=True):
    from replay.diff import Tolerance
    from replay.plant import Plant
    from replay.replayer import ReplayOptions
    from replay.runners import parse_overrides

    return ReplayOptions(mode=mode, overrides=parse_overrides(set_), steps=steps,
                         tolerance=Tolerance(atol, rtol, tie_margin), repeat=repeat, force=force,
                         plant=Plant.parse(plant) if plant else None, diff=diff, progress=sys.stderr.isatty())


ModeOpt = typer.Option("forced", "--mode", help="forced: recorded tokens fed back each step (local diffs); free: the runner's own.")
SetOpt = typer.Option(None, "--set", help="Override a knob for the replay: dtype, attention, threads, device, model, seed (repeatable).")
StepsOpt = typer.Option(None, "--steps", help="Diff only steps A-B (steps before A still run: state is rebuilt from step 0).")
AtolOpt = typer.Option(0.0, "--atol", min=0, help="Absolute logprob tolerance (default: bitwise).")
RtolOpt = typer.Option(0.0, "--rtol", min=0, help="Relative logprob tolerance (default: bitwise).")
TieOpt = typer.Option(0.05, "--tie-margin", min=0, help="A token flip at a top1-top2 margin below this is a tie flip.")
ForceOpt = typer.Option(False, "--force", help="Replay even on a model whose weights differ from the recording's.")
PlantOpt = typer.Option(None, "--plant", help="Plant a divergence: STEP:REQUEST:MODULE:SIZE adds SIZE to that module's output.")


@command
def run(
    capture: Path = CaptureArg,
    diff: bool = typer.Option(False, "--diff", help="Diff tokens and logprobs against the recording."),
    mode: str = ModeOpt,
    set_: Optional[list[str]] = SetOpt,
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
    from replay.replayer import replay_capture

    rep = replay_capture(capture, _replay_options(mode, set_, steps, atol, rtol, tie_margin, repeat, force, plant, diff))
    if json:
        from replay.jsonable import dumps

        print(dumps(rep))
    elif diff:
        from replay.render import render_replay

        print(render_replay(rep))
    else:
        print(f"replayed {rep.steps_replayed} steps in {rep.replay_s:.3f} s (the recording's runner took "
              f"{rep.record_execute_s:.3f} s)" + (f"; {rep.run_to_run}" if rep.run_to_run else ""))
    if diff and rep.diverged:
        raise typer.Exit(1)


@command
def check(
    capture: Path = CaptureArg,
    mode: str = ModeOpt,
    set_: Optional[list[str]] = SetOpt,
    atol: float = AtolOpt,
    rtol: float = RtolOpt,
    force: bool = ForceOpt,
) -> None:
    """Predicate for `git bisect run`: 0 replays within tolerance, 1 diverges, 125 cannot test."""
    from replay.replayer import check_capture

    try:
        opts = _replay_options(mode, set_, None, atol, rtol, 0.05, 1, force, None)
    except Exception as e:  # even a bad flag must not read as "bad commit" to git bisect
        _err(str(e))
        raise typer.Exit(125) from None
    code = check_capture(capture, opts)
    _err({0: "good: replays within tolerance", 1: "bad: diverges", 125: "cannot test"}[code])
    raise typer.Exit(code)


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
    from replay.compare import diff_captures
    from replay.diff import Tolerance

    res = diff_captures(a, b, Tolerance(atol, rtol, tie_margin))
    _emit(res, json, "render_capture_diff")
    if res.diverged:
        raise typer.Exit(1)


bisect_app = typer.Typer(help="Narrow a divergence down: to a step, a co-batched request, a module, a knob.",
                         no_args_is_help=True, rich_markup_mode=None)
app.add_typer(bisect_app, name="bisect")


def _bisect_command(fn):
    """Register `replay bisect NAME` for a function named `bisect_NAME`."""
    return bisect_app.command(fn.__name__.removeprefix("bisect_"))(_guarded(fn))


def _log(quiet: bool):
    from replay.bisect.session import stderr_log

    return (lambda msg: None) if quiet else stderr_log


QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress lines on stderr.")
StateOpt = typer.Option(None, "--state", help="JSON file keeping every re-execution's result: an interrupted run resumes from it.")


@_bisect_command
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


@_bisect_command
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


@_bisect_command
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


@_bisect_command
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


@command
def stress(
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Text prompt (the model's tokenizer)."),
    prompt_token_ids: Optional[str] = typer.Option(None, "--prompt-token-ids", help="Comma-separated token ids."),
    model: str = typer.Option("tiny", "--model", "-m"),
    dtype: str = typer.Option("float32", "--dtype"),
    trials: int = typer.Option(20, "--trials", min=2, help="How many times to run the prompt."),
    max_tokens: int = typer.Option(24, "--max-tokens", min=1),
    neighbours: str = typer.Option("0:12", "--neighbours", help="MIN:MAX random co-batched requests per trial."),
    batch_invariant: bool = typer.Option(False, "--batch-invariant", help="Run the builtin runner's batch-invariant mode."),
    threads: int = typer.Option(1, "--threads", min=1),
    seed: int = typer.Option(0, "--seed"),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
    json: bool = JsonOpt,
) -> None:
    """The same prompt N times, greedy, under varied co-batching: how many unique completions and logprob sequences?"""
    from replay.engine.config import EngineConfig, RunnerConfig
    from replay.errors import UsageError
    from replay.stress import stress as run_it

    if (prompt is None) == (prompt_token_ids is None):
        raise UsageError("give exactly one of --prompt and --prompt-token-ids")
    if prompt is not None:
        from replay.engine.tokenizer import load_tokenizer

        tok = load_tokenizer(model)
        if tok is None:
            raise UsageError(f"{model}: no tokenizer.json; use --prompt-token-ids")
        ids = tok.encode(prompt)
    else:
        try:
            ids = [int(x) for x in prompt_token_ids.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--prompt-token-ids {prompt_token_ids!r}: expected comma-separated integers") from None
    cfg = EngineConfig(model=model, runner=RunnerConfig(dtype=dtype, num_threads=threads, batch_invariant=batch_invariant))
    res = run_it(ids, cfg, trials=trials, max_tokens=max_tokens, neighbours=_range(neighbours, "--neighbours"),
                 seed=seed, log=_log(quiet))
    if json:
        from replay.jsonable import dumps

        print(dumps(res))
        return
    print(res.verdict)
    f = res.first_fork
    if f is not None:
        print(f"  trials {f.trials[0]} and {f.trials[1]} part at output position {f.position}: the target ran in batches of "
              f"{f.batch_sizes[0]} and {f.batch_sizes[1]} requests ({f.batch_tokens[0]} and {f.batch_tokens[1]} tokens)")


def _range(text: str, flag: str) -> tuple[int, int]:
    from replay.errors import UsageError

    try:
        lo, _, hi = text.partition(":")
        return int(lo), int(hi or lo)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected MIN:MAX (integers)") from None


@command
def record(
    prompts: Optional[Path] = typer.Option(None, "--prompts", "-p", help="JSONL: prompt or prompt_token_ids, request_id, arrival_step, SamplingParams fields."),
    model: str = typer.Option("tiny", "--model", "-m", help="'tiny' (builtin, generated from a fixed seed) or a local HF checkpoint directory."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:1, ..."),
    attention: str = typer.Option("sdpa", "--attention", help="Attention implementation: sdpa | reference."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch intra-op threads."),
    max_num_seqs: int = typer.Option(32, "--max-num-seqs", min=1),
    max_num_batched_tokens: int = typer.Option(256, "--max-num-batched-tokens", min=1),
    block_size: int = typer.Option(16, "--block-size", min=1),
    num_blocks: int = typer.Option(512, "--num-blocks", min=1),
    max_model_len: int = typer.Option(2048, "--max-model-len", min=2),
    prefix_caching: bool = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching"),
    batch_invariant: bool = typer.Option(False, "--batch-invariant", help="Batch-invariant runner (slower; see README)."),
    seed: int = typer.Option(0, "--seed", help="Engine seed (seeds drawn for unseeded requests) and synthetic workload seed."),
    num_requests: int = typer.Option(16, "--num-requests", min=1, help="Synthetic workload: requests."),
    prompt_len: str = typer.Option("8:48", "--prompt-len", help="Synthetic workload: MIN:MAX prompt tokens."),
    output_len: str = typer.Option("8:32", "--output-len", help="Synthetic workload: MIN:MAX output tokens."),
    arrival_rate: float = typer.Option(2.0, "--arrival-rate", min=0, help="Synthetic workload: mean arrivals per step (0: all at once)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", min=0, help="Sampling default for every request."),
    top_p: Optional[float] = typer.Option(None, "--top-p", min=0, max=1),
    top_k: Optional[int] = typer.Option(None, "--top-k"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", min=-1),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Capture path (default: captures/<model>-<time>.capture)."),
    flush_interval: float = typer.Option(1.0, "--flush-interval", min=0.01, help="Seconds before an open chunk is written: bounds what a crash of the writer can lose."),
    force: bool = typer.Option(False, "--force", help="Overwrite OUT if it exists."),
    json: bool = JsonOpt,
) -> None:
    """Run the builtin engine on a workload with the tap on; write every step to a capture."""
    import time as _time

    from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
    from replay.record import RecordOptions
    from replay.record import record as do_record
    from replay.workload import SyntheticWorkload, load_jsonl, synthetic

    defaults = {k: v for k, v in dict(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                      logprobs=logprobs).items() if v is not None}
    cfg = EngineConfig(
        model=model,
        scheduler=SchedulerConfig(block_size=block_size, num_gpu_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                  enable_prefix_caching=prefix_caching),
        runner=RunnerConfig(dtype=dtype, device=device, attention_impl=attention, num_threads=threads, seed=seed,
                            batch_invariant=batch_invariant),
    )
    if prompts is not None:
        reqs = load_jsonl(prompts, defaults)
    else:
        from replay.engine.weights import load_model_config_for

        vocab = load_model_config_for(model).vocab_size
        reqs = synthetic(SyntheticWorkload(num_requests=num_requests, prompt_len=_range(prompt_len, "--prompt-len"),
                                           output_len=_range(output_len, "--output-len"), arrival_rate=arrival_rate,
                                           seed=seed, defaults=defaults), vocab)
    if out is None:
        stem = Path(model).name if model != "tiny" else "tiny"
        out = Path("captures") / f"{stem}-{_time.strftime('%Y%m%d-%H%M%S')}.capture"
    res = do_record(RecordOptions(cfg, reqs, out, overwrite=force, progress=sys.stderr.isatty(),
                                  flush_interval=flush_interval))
    if json:
        from replay.jsonable import dumps

        print(dumps(res))
    else:
        print(f"recorded {res.steps} steps, {res.requests} requests, {res.prompt_tokens} prompt + "
              f"{res.generated_tokens} generated tokens in {res.wall_s:.2f} s ({res.tokens_per_s:,.0f} tokens/s)\n"
              f"capture {res.path} ({res.capture_bytes:,} bytes)")


@command
def demo(
    output: Path = typer.Option(Path("captures/demo.capture"), "--output", "-o", help="Where to write the demo capture."),
) -> None:
    """The main job on the embedded default: record the default workload on `tiny`, inspect the capture, replay it
    bit for bit, then replay it in bfloat16 to show what a divergence report looks like."""
    from replay.engine.config import EngineConfig, RunnerConfig
    from replay.record import RecordOptions
    from replay.record import record as do_record
    from replay.render import render_info, render_replay
    from replay.replayer import ReplayOptions, replay_capture
    from replay.summary import capture_info
    from replay.workload import SyntheticWorkload, synthetic

    res = do_record(RecordOptions(EngineConfig(runner=RunnerConfig(num_threads=1)), synthetic(SyntheticWorkload(), 512),
                                  output, overwrite=True, progress=sys.stderr.isatty()))
    print(f"$ replay record --out {res.path}\nrecorded {res.steps} steps, {res.requests} requests, "
          f"{res.generated_tokens} generated tokens on tiny in {res.wall_s:.2f} s\n")
    print(f"$ replay info {res.path}\n{render_info(capture_info(res.path))}\n")
    print(f"$ replay run {res.path} --diff\n{render_replay(replay_capture(res.path))}\n")
    bf16 = replay_capture(res.path, ReplayOptions(overrides={"dtype": "bfloat16"}))
    print(f"$ replay run {res.path} --diff --set dtype=bfloat16\n{render_replay(bf16)}")


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
