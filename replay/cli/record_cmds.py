"""Commands that run an engine: record, demo, stress."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from replay.cli.common import (
    ForceOpt,
    FromStartOpt,
    JobsOpt,
    JsonOpt,
    QuietOpt,
    RayAddressOpt,
    RayOpt,
    RunnerOpt,
    command,
    emit,
    fan_out_options,
    int_range,
    knobs_with_runner,
    progress_log,
)
from replay.engine.config import RunnerConfig, SchedulerConfig
from replay.errors import EXIT_DAMAGED, UsageError

# The builtin engine's defaults, for --help only: `replay.record.builtin_config` applies them, the CLI passes only
# what the user gave.
_SC, _RC = SchedulerConfig(), RunnerConfig()


@command
def record(
    prompts: Path | None = typer.Option(None, "--prompts", "-p",
                                        help="JSONL: prompt or prompt_token_ids, request_id, arrival_step, "
                                             "SamplingParams fields."),
    engine: str = typer.Option("builtin", "--engine", "-e",
                               help="builtin (the reference engine) | vllm (a real vLLM engine, in-process, with the "
                                    "tap attached)."),
    model: str = typer.Option("tiny", "--model", "-m",
                              help="'tiny' (builtin, generated from a fixed seed) or a local HF checkpoint directory."),
    dtype: str | None = typer.Option(None, "--dtype",
                                     help=f"{_RC.dtype} (default) | bfloat16 | float16 | float64 (builtin)."),
    device: str | None = typer.Option(None, "--device",
                                      help=f"Builtin engine: {_RC.device} (default), cuda, cuda:1, ..."),
    attention: str | None = typer.Option(None, "--attention",
                                         help=f"Builtin engine: batched | sdpa | reference (default "
                                              f"{_RC.attention_impl}; sdpa attends per request)."),
    threads: int | None = typer.Option(None, "--threads", min=1, help="Builtin engine: torch intra-op threads."),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", min=1,
                                            help=f"Default {_SC.max_num_seqs} (builtin) or vLLM's."),
    max_num_batched_tokens: int | None = typer.Option(None, "--max-num-batched-tokens", min=1,
                                                      help=f"Default {_SC.max_num_batched_tokens} (builtin) or "
                                                           "vLLM's."),
    block_size: int | None = typer.Option(None, "--block-size", min=1,
                                          help=f"Default {_SC.block_size} (builtin) or vLLM's (a multiple of 32 on "
                                               f"CPU)."),
    num_blocks: int | None = typer.Option(None, "--num-blocks", min=1,
                                          help=f"KV blocks. Default {_SC.num_gpu_blocks} (builtin) or what vLLM's "
                                               f"memory budget gives."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", min=2,
                                             help=f"Default {_SC.max_model_len} (builtin) or the model's."),
    prefix_caching: bool | None = typer.Option(None, "--enable-prefix-caching/--no-enable-prefix-caching",
                                               help=f"Default {'on' if _SC.enable_prefix_caching else 'off'}."),
    batch_invariant: bool | None = typer.Option(None, "--batch-invariant",
                                                help="Builtin engine: batch-invariant runner (slower; docs/guide.md, "
                                                     "'replay stress and the batch-invariant mode')."),
    seed: int | None = typer.Option(None, "--seed",
                                    help="Engine seed (seeds drawn for unseeded requests) and synthetic workload seed "
                                         "(default 0)."),
    num_requests: int = typer.Option(16, "--num-requests", min=1, help="Synthetic workload: requests."),
    prompt_len: str = typer.Option("8:48", "--prompt-len", help="Synthetic workload: MIN:MAX prompt tokens."),
    output_len: str = typer.Option("8:32", "--output-len", help="Synthetic workload: MIN:MAX output tokens."),
    arrival_rate: float = typer.Option(2.0, "--arrival-rate", min=0,
                                       help="Synthetic workload: mean arrivals per step (0: all at once)."),
    temperature: float | None = typer.Option(None, "--temperature", min=0, help="Sampling default for every request."),
    top_p: float | None = typer.Option(None, "--top-p", min=0, max=1),
    top_k: int | None = typer.Option(None, "--top-k"),
    max_tokens: int | None = typer.Option(None, "--max-tokens", min=1),
    logprobs: int | None = typer.Option(None, "--logprobs", min=-1),
    out: Path | None = typer.Option(None, "--out", "-o",
                                    help="Capture path (default: captures/<model>-<time>.capture)."),
    flush_interval: float | None = typer.Option(None, "--flush-interval", min=0.01,
                                                help="Seconds before an open chunk is written (default 1): bounds "
                                                     "what a crash of the writer can lose."),
    ring: str | None = typer.Option(None, "--ring",
                                    help="Builtin engine: record into a ring of SIZE bytes (e.g. 4MB) in the "
                                         "directory OUT: a bounded flight recorder; `replay snapshot OUT` seals its "
                                         "window."),
    keyframe_steps: int | None = typer.Option(None, "--keyframe-steps", min=0,
                                              help="Steps between keyframes, where a replay or a bisect can start "
                                                   "(default 4096, or REPLAY_KEYFRAME_STEPS; 0: none)."),
    vllm_arg: list[str] | None = typer.Option(None, "--vllm-arg",
                                              help="vLLM engine: any vLLM engine argument, NAME=VALUE by vLLM's name, "
                                                   "e.g. gpu_memory_utilization=0.5 (repeatable)."),
    force: bool = typer.Option(False, "--force", help="Overwrite OUT if it exists."),
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """Run an engine (builtin, or a real vLLM) on a workload with the tap on; write every step to a capture."""
    from replay.capture.flight import parse_size
    from replay.cli.render_capture import render_record
    from replay.record import EngineOptions, SyntheticWorkload, workload_requests
    from replay.record import record as do_record
    from replay.record.options import parse_vllm_args

    options = EngineOptions(engine, model, dtype=dtype, seed=seed, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                            num_blocks=num_blocks, max_model_len=max_model_len, enable_prefix_caching=prefix_caching,
                            device=device, attention=attention, threads=threads, batch_invariant=batch_invariant,
                            vllm_args=parse_vllm_args(vllm_arg))
    sampling = {k: v for k, v in dict(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                      logprobs=logprobs).items() if v is not None}
    workload = SyntheticWorkload(num_requests=num_requests, prompt_len=int_range(prompt_len, "--prompt-len"),
                                 output_len=int_range(output_len, "--output-len"), arrival_rate=arrival_rate,
                                 defaults=sampling, **({} if seed is None else {"seed": seed}))
    res = do_record(options, workload_requests(model, prompts, workload), out, overwrite=force,
                    progress=sys.stderr.isatty() and not quiet, flush_interval=flush_interval,
                    keyframe_steps=keyframe_steps,
                    ring=parse_size(ring, "--ring") if ring else None)
    emit(res, render_record, json=json)


@command
def snapshot(
    ring: Path = typer.Argument(...,
                                help="The ring's directory (REPLAY_CAPTURE of a recorder with REPLAY_CAPTURE_RING "
                                     "set, or `record --ring SIZE --out DIR`).", show_default=False),
    after: int = typer.Option(0, "--after", min=0, help="Wait for N more steps first."),
    timeout: float = typer.Option(600.0, "--timeout", min=1, help="Seconds to wait for the snapshot."),
    json: bool = JsonOpt,
) -> None:
    """Seal a ring's window (its segments, each opening with a keyframe) into one capture that info, run, diff,
    report and check take; print its path, last. Works from another shell against a running recorder, or on the
    segments a stopped one left."""
    from replay.capture.flight.control import request_snapshot
    from replay.cli.render_capture import render_snapshot

    emit(request_snapshot(ring, after, timeout), render_snapshot, json=json)


@command
def demo(
    output: Path = typer.Option(Path("captures/demo.capture"), "--output", "-o",
                                help="Where to write the demo capture."),
    quiet: bool = QuietOpt,
) -> None:
    """The main job on the embedded default: record the default workload on `tiny`, inspect the capture, replay it
    bit for bit, then replay it in bfloat16 to show what a divergence report looks like."""
    from replay.cli.render_replay import render_demo
    from replay.demo import run_demo

    emit(run_demo(output, progress=sys.stderr.isatty() and not quiet), render_demo)


@command
def stress(
    capture: Path | None = typer.Argument(None, show_default=False,
                                          help="A capture: stress one of its requests (--request) among the "
                                               "neighbours it really had, on its model and layout."),
    request: str | None = typer.Option(None, "--request", help="With a capture: the request (external or internal "
                                                                "id) to replay with random subsets of its neighbours."),
    prompt: str | None = typer.Option(None, "--prompt", help="Text prompt (the model's tokenizer)."),
    prompt_token_ids: str | None = typer.Option(None, "--prompt-token-ids", help="Comma-separated token ids."),
    model: str | None = typer.Option(None, "--model", "-m", help="The model a prompt runs on [default: tiny]."),
    dtype: str | None = typer.Option(None, "--dtype", help=f"{_RC.dtype} (default) | bfloat16 | float16 | float64."),
    trials: int = typer.Option(20, "--trials", min=2, help="How many times to run the prompt."),
    max_tokens: int = typer.Option(24, "--max-tokens", min=1),
    neighbours: str = typer.Option("0:12", "--neighbours", help="MIN:MAX random co-batched requests per trial."),
    batch_invariant: bool | None = typer.Option(None, "--batch-invariant",
                                                help="Run the builtin runner's batch-invariant mode."),
    threads: int | None = typer.Option(None, "--threads", min=1, help="[default: 1 for a prompt]"),
    seed: int = typer.Option(0, "--seed"),
    set_: list[str] | None = typer.Option(None, "--set",
                                          help="env.NAME=VALUE: an environment variable the engine runs with "
                                               "(repeatable); on a capture, any replay knob."),
    runner: str | None = RunnerOpt,
    from_start: bool = FromStartOpt,
    force: bool = ForceOpt,
    jobs: int = JobsOpt,
    ray: bool = RayOpt,
    ray_address: str | None = RayAddressOpt,
    quiet: bool = QuietOpt,
    json: bool = JsonOpt,
) -> None:
    """The same prompt N times, greedy, under varied co-batching: how many unique completions and logprob sequences?
    Trials run in parallel with --jobs or --ray (their co-batching is drawn up front: the answer is the serial one).
    On a capture: its request --request, replayed N times from the keyframe nearest it, each time leaving out
    another random subset of the neighbours it really had; exit 3 when the capture lost data (the request's steps
    end where its readable prefix does)."""
    from replay.cli.render_replay import render_stress
    from replay.record import EngineOptions, builtin_config
    from replay.record.stress import prompt_ids
    from replay.record.stress import stress as run_it
    from replay.replayer import parse_overrides
    from replay.replayer.knobs import env_knobs

    knobs = parse_overrides([*knobs_with_runner(set_, runner),
                             *([f"dtype={dtype}"] if dtype else []), *([f"threads={threads}"] if threads else []),
                             *([f"batch_invariant={str(batch_invariant).lower()}"] if batch_invariant is not None
                               else [])])
    if capture is not None:
        from replay.bisect.stress_capture import stress_capture

        if request is None or prompt is not None or prompt_token_ids is not None or model is not None:
            raise UsageError("on a capture, stress takes --request (the capture says the prompt and the model; "
                             "--set model=PATH replays on another)")
        if jobs > 1 or ray or ray_address:
            raise UsageError("on a capture, stress runs its trials on one engine: --jobs and --ray are for a prompt")
        res = stress_capture(capture, request, trials=trials, seed=seed, overrides=knobs, force=force,
                             from_start=from_start, log=progress_log(quiet))
        emit(res, render_stress, json=json)
        if res.data_lost:
            raise typer.Exit(EXIT_DAMAGED)
        return
    other = [k for k in parse_overrides(set_) if not k.startswith("env.")]
    if other:
        raise UsageError(f"--set {other[0]}: on a prompt, stress runs the builtin engine; its knobs are --dtype, "
                         "--threads and --batch-invariant, and --set takes env.NAME=VALUE")
    if request is not None or from_start or force:
        raise UsageError("--request, --from-start and --force are for a capture (replay stress CAPTURE --request R)")
    cfg = builtin_config(EngineOptions(model=model or "tiny", dtype=dtype, threads=threads or 1,
                                       batch_invariant=batch_invariant))
    res = run_it(prompt_ids(model or "tiny", prompt, prompt_token_ids), cfg, trials=trials, max_tokens=max_tokens,
                 neighbours=int_range(neighbours, "--neighbours"), seed=seed, log=progress_log(quiet),
                 how=fan_out_options(jobs, ray, ray_address), env=env_knobs(knobs))
    emit(res, render_stress, json=json)
