"""`record_builtin`: run the builtin engine on a workload with the tap on, into a capture."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from replay.capture.flight import RingDirectory
from replay.capture.flight.ring_process import ring_writer
from replay.capture.writing.writer_process import ProcessCaptureWriter
from replay.engine.config import EngineConfig
from replay.errors import UsageError
from replay.record.result import ProgressBar, RecordResult
from replay.record.tap import CaptureTap, StepListener
from replay.record.workload import Arrivals, WorkloadRequest

if TYPE_CHECKING:
    from replay.engine.engine import LLMEngine


@dataclass(slots=True)
class RecordOptions:
    """What to run and where to write it."""

    engine: EngineConfig
    requests: list[WorkloadRequest]
    out: Path
    overwrite: bool = False
    progress: bool = False
    listeners: list[StepListener] = field(default_factory=list)  # extra listeners (tests, benchmarks)
    tap: bool = True  # False: run without recording (the tap-overhead benchmark's baseline)
    flush_interval: float | None = None  # seconds; bounds what a crash of the writer can lose (default 1 s)
    keyframe_steps: int | None = None  # steps between keyframes (None: REPLAY_KEYFRAME_STEPS or the default; 0: none)
    ring: int | None = None  # bytes: record into a ring of segments in the directory `out` (a flight recorder)


def _tokenize(engine: LLMEngine, reqs: list[WorkloadRequest]) -> list[list[int]]:
    from replay.engine.tokenizer import load_tokenizer

    tok = None
    out = []
    for r in reqs:
        if r.prompt_token_ids is not None:
            out.append(r.prompt_token_ids)
            continue
        if tok is None:
            tok = load_tokenizer(engine.config.model)
            if tok is None:
                raise UsageError(f"{engine.config.model}: no tokenizer.json next to the checkpoint; give "
                                 "prompt_token_ids instead of text prompts")
        out.append(tok.encode(r.prompt))
    return out


def run_engine(engine: LLMEngine, reqs: list[WorkloadRequest], progress: bool = False) -> tuple[int, int, int]:
    """Feed `reqs` to `engine` at their arrival steps and step until all finish.
    Returns (steps, prompt tokens, generated tokens)."""
    prompts = _tokenize(engine, reqs)
    arrivals = Arrivals(reqs)
    bar = ProgressBar(arrivals.expected_tokens) if progress else None
    generated = 0
    start = engine.step_index
    try:
        while arrivals or engine.has_unfinished_requests():
            for i, r in arrivals.due(engine.step_index - start, idle=not engine.has_unfinished_requests()):
                engine.add_request(prompts[i], r.params, r.request_id)
            outs = engine.step()
            n = sum(len(o.new_token_ids) for o in outs.outputs)
            generated += n
            if bar is not None:
                bar.advance(n)
    finally:
        if bar is not None:
            bar.close()
    return engine.step_index - start, sum(map(len, prompts)), generated


def record_builtin(opts: RecordOptions) -> RecordResult:
    """Build the engine, run the workload with the tap on, close the capture, summarise."""
    from replay.engine.engine import LLMEngine

    constrained = next((r for r in opts.requests if r.params.structured_outputs), None)
    if constrained is not None:
        raise UsageError(f"request {constrained.request_id or '?'}: structured_outputs needs a grammar backend, which "
                         "the builtin engine does not have (record it with --engine vllm; replay works on both)")
    for i, r in enumerate(opts.requests):  # what only vLLM's front end does (fan-out, text stops, word tokens)
        unsupported = [name for name, on in (("n > 1", r.params.n != 1), ("stop strings", bool(r.params.stop)),
                                             ("bad_words", bool(r.params.bad_words))) if on]
        if unsupported:
            raise UsageError(f"request {r.request_id or i}: {', '.join(unsupported)}: the builtin engine has no "
                             "front end for it (record it with --engine vllm; replay works on both)")
    engine = LLMEngine(opts.engine, listeners=list(opts.listeners))
    writer = tap = None
    if opts.tap:
        extra = {} if opts.flush_interval is None else {"flush_interval": opts.flush_interval}
        if opts.ring:
            writer = ring_writer(opts.out, engine.header(), opts.ring, overwrite=opts.overwrite, **extra)
        else:
            writer = ProcessCaptureWriter(opts.out, engine.header(), overwrite=opts.overwrite,
                                          keyframes=opts.keyframe_steps, **extra)
        tap = CaptureTap(writer)
        engine.listeners.append(tap)
    t = time.perf_counter()
    try:
        steps, prompt_tokens, generated = run_engine(engine, opts.requests, opts.progress)
    except BaseException as e:
        if writer is not None:
            writer.close(status=tap.crash_status or f"error: {type(e).__name__}: {e}"[:500])
        raise
    wall = time.perf_counter() - t
    size = 0
    if writer is not None:
        writer.close()
        # a ring: what its segments hold on disk
        size = sum(p.stat().st_size
                   for p in RingDirectory(opts.out).segments()) if opts.ring else opts.out.stat().st_size
    return RecordResult.of(opts.out, steps, len(opts.requests), prompt_tokens, generated, wall, size)
