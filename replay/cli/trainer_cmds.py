"""`replay trainer`: does my trainer agree with my sampler?"""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.common import CaptureArg, JsonOpt, PlantOpt, RunnerOpt, command, emit


@command
def trainer(
    capture: Path = CaptureArg,
    model: str | None = typer.Option(None, "--model", help="The trainer's checkpoint (default: the recording's)."),
    dtype: str | None = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16 (default: the "
                                                           "recording's)."),
    attn: str = typer.Option("sdpa", "--attn", help="The trainer's attention: sdpa | eager | flash_attention_2 "
                                                    "(flash-attn installed, on a GPU)."),
    device: str = typer.Option("cpu", "--device", help="Where the trainer's forward runs: cpu | cuda | cuda:N (as "
                                                       "the trainer runs it)."),
    micro_batch: int = typer.Option(8, "--micro-batch", min=1, help="Sequences per forward (right-padded)."),
    pack: bool = typer.Option(False, "--pack", help="Pack each micro-batch into one row (position ids restarting, a "
                                                    "block-diagonal causal mask) instead of padding."),
    request: list[str] | None = typer.Option(None, "--request", help="Only this request (repeatable)."),
    clip: float = typer.Option(2.0, "--clip", min=0.0, help="C of the truncated importance sampling clip."),
    worst: int = typer.Option(5, "--worst", min=0, help="How many of the worst tokens to list."),
    bisect: bool = typer.Option(False, "--bisect", help="Name the first module where the replay (vLLM's runner for a "
                                                        "vLLM capture) and the trainer part, at the worst token."),
    token: str | None = typer.Option(None, "--token", help="REQUEST:POSITION: bisect this token (implies --bisect)."),
    plant: str | None = PlantOpt,
    runner: str | None = RunnerOpt,
    dump: Path | None = typer.Option(None, "--dump", help="With --bisect: write both sides' module outputs here."),
    against: str = typer.Option("transformers", "--against", help="With --bisect, the trainer's side: transformers "
                                                                  "(its forward) | builtin (the builtin runner's "
                                                                  "replay of the step, beside vLLM's runner; "
                                                                  "implies --bisect)."),
    json: bool = JsonOpt,
) -> None:
    """Score every rollout as an RL trainer does (one teacher-forced transformers forward, log_softmax(logits / T)
    over the whole vocabulary) against the logprobs vLLM returned, like for like: mean and max |Δ|, the k3 KL, what
    a truncated-importance-sampling clip at C would touch, Δ by position, the worst tokens. Differences of meaning
    (raw logprobs of a tempered request, top-p renormalisation) are named and not counted. --bisect: the first module
    where the replay of the token's step and the trainer's forward part beyond the dtype's tolerance. Exit 3 when the
    capture lost data (what it holds is scored)."""
    from replay.cli.render_trainer import render_trainer
    from replay.errors import EXIT_DAMAGED, UsageError
    from replay.replayer import Plant
    from replay.trainer import TrainerOptions, score_capture

    where = None
    if token is not None:
        name, _, pos = token.rpartition(":")
        if not name or not pos.isdigit():
            raise UsageError(f"--token {token}: expected REQUEST:POSITION")
        where = (name, int(pos))
    res = score_capture(capture, TrainerOptions(
        model, dtype, attn, micro_batch, request or None, pack, clip, worst,
        bisect or where is not None or against != "transformers", where,
        Plant.parse(plant) if plant else None, runner, str(dump) if dump else None, against, device))
    emit(res, render_trainer, json=json)
    if res.data_lost:
        raise typer.Exit(EXIT_DAMAGED)
