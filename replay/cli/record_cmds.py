"""Commands that run the builtin engine: record, demo, stress."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from replay.cli.common import JsonOpt, _log, _range, command


@command
def record(
    prompts: Optional[Path] = typer.Option(None, "--prompts", "-p", help="JSONL: prompt or prompt_token_ids, request_id, arrival_step, SamplingParams fields."),
    engine: str = typer.Option("builtin", "--engine", "-e", help="builtin (the reference engine) | vllm (a real vLLM engine, in-process, with the tap attached)."),
    model: str = typer.Option("tiny", "--model", "-m", help="'tiny' (builtin, generated from a fixed seed) or a local HF checkpoint directory."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16."),
    device: Optional[str] = typer.Option(None, "--device", help="Builtin engine: cpu (default), cuda, cuda:1, ..."),
    attention: Optional[str] = typer.Option(None, "--attention", help="Builtin engine: sdpa (default) | reference."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Builtin engine: torch intra-op threads."),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", min=1, help="Default 32 (builtin) or vLLM's."),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens", min=1, help="Default 256 (builtin) or vLLM's."),
    block_size: Optional[int] = typer.Option(None, "--block-size", min=1, help="Default 16 (builtin) or vLLM's (a multiple of 32 on CPU)."),
    num_blocks: Optional[int] = typer.Option(None, "--num-blocks", min=1, help="KV blocks. Default 512 (builtin) or what vLLM's memory budget gives."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", min=2, help="Default 2048 (builtin) or the model's."),
    prefix_caching: bool = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching"),
    batch_invariant: bool = typer.Option(False, "--batch-invariant", help="Builtin engine: batch-invariant runner (slower; see README)."),
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
    """Run an engine (builtin, or a real vLLM) on a workload with the tap on; write every step to a capture."""
    import time as _time

    from replay.errors import UsageError
    from replay.workload import SyntheticWorkload, load_jsonl, synthetic

    if engine not in ("builtin", "vllm"):
        raise UsageError(f"--engine {engine!r}: expected builtin or vllm")
    defaults = {k: v for k, v in dict(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                      logprobs=logprobs).items() if v is not None}
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
    if engine == "vllm":
        builtin_only = {"--device": device, "--attention": attention, "--threads": threads,
                        "--batch-invariant": batch_invariant or None}
        given = [k for k, v in builtin_only.items() if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: builtin engine only (vLLM picks its own device and kernels)")
        if model == "tiny":
            raise UsageError("--engine vllm needs --model PATH, a local checkpoint directory ('tiny' is builtin only)")
        from replay.integrations.vllm.record import VllmRecordOptions, record_vllm

        res = record_vllm(VllmRecordOptions(
            model, reqs, out, dtype=dtype, seed=seed, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, num_gpu_blocks_override=num_blocks,
            max_model_len=max_model_len, enable_prefix_caching=prefix_caching, overwrite=force,
            progress=sys.stderr.isatty()))
    else:
        from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
        from replay.record import RecordOptions
        from replay.record import record as do_record

        cfg = EngineConfig(
            model=model,
            scheduler=SchedulerConfig(block_size=block_size or 16, num_gpu_blocks=num_blocks or 512,
                                      max_num_seqs=max_num_seqs or 32,
                                      max_num_batched_tokens=max_num_batched_tokens or 256,
                                      max_model_len=max_model_len or 2048, enable_prefix_caching=prefix_caching),
            runner=RunnerConfig(dtype=dtype, device=device or "cpu", attention_impl=attention or "sdpa",
                                num_threads=threads, seed=seed, batch_invariant=batch_invariant),
        )
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
