"""`record`: run the builtin engine on a workload with the tap on, into a capture (`replay record`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from replay.capture.writer_process import ProcessCaptureWriter
from replay.engine.config import EngineConfig
from replay.errors import UsageError
from replay.tap import CaptureTap
from replay.workload import WorkloadRequest


class RecordResult(msgspec.Struct):
    """The summary `replay record` prints."""

    path: str
    steps: int
    requests: int
    prompt_tokens: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float  # (prompt + generated) tokens / wall time
    capture_bytes: int


@dataclass(slots=True)
class RecordOptions:
    """What to run and where to write it."""

    engine: EngineConfig
    requests: list[WorkloadRequest]
    out: Path
    overwrite: bool = False
    progress: bool = False
    listeners: list = field(default_factory=list)  # extra StepListeners (tests, benchmarks)
    tap: bool = True  # False: run without recording (the tap-overhead benchmark's baseline)
    flush_interval: float | None = None  # seconds; bounds what a crash of the writer can lose (default 1 s)


def _tokenize(engine, reqs: list[WorkloadRequest]) -> list[list[int]]:
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


def run_engine(engine, reqs: list[WorkloadRequest], progress: bool = False) -> tuple[int, int, int]:
    """Feed `reqs` to `engine` at their arrival steps and step until all finish.
    Returns (steps, prompt tokens, generated tokens)."""
    prompts = _tokenize(engine, reqs)
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival_step, i))
    pending = [(reqs[i], prompts[i]) for i in order]
    total = sum(r.params.max_tokens or 16 for r in reqs)
    bar = ProgressBar(total) if progress else None
    generated = 0
    start = engine.step_index
    try:
        while pending or engine.has_unfinished_requests():
            # arrivals due now; an idle engine jumps ahead to the next arrival instead of spinning on empty steps
            due = engine.step_index - start
            if not engine.has_unfinished_requests() and pending:
                due = max(due, pending[0][0].arrival_step)
            while pending and pending[0][0].arrival_step <= due:
                r, ids = pending.pop(0)
                engine.add_request(ids, r.params, r.request_id)
            outs = engine.step()
            n = sum(len(o.new_token_ids) for o in outs.outputs)
            generated += n
            if bar is not None:
                bar.advance(n)
    finally:
        if bar is not None:
            bar.close()
    return engine.step_index - start, sum(map(len, prompts)), generated


class ProgressBar:
    """A stderr progress bar (rich) over generated tokens."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._p = Progress(TextColumn("recording"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                           TimeElapsedColumn(), transient=True)
        self._p.start()
        self._task = self._p.add_task("record", total=total)

    def advance(self, n: int) -> None:
        self._p.advance(self._task, n)

    def close(self) -> None:
        self._p.stop()


def record(opts: RecordOptions) -> RecordResult:
    """Build the engine, run the workload with the tap on, close the capture, summarise."""
    from replay.engine.engine import LLMEngine
    from replay.environment import current_environment, make_header

    constrained = next((r for r in opts.requests if r.params.structured_outputs), None)
    if constrained is not None:
        raise UsageError(f"request {constrained.request_id or '?'}: structured_outputs needs a grammar backend, which "
                         "the builtin engine does not have (record it with --engine vllm; replay works on both)")
    engine = LLMEngine(opts.engine, listeners=list(opts.listeners))
    writer = None
    if opts.tap:
        header = make_header("builtin", engine_version=_version(), model=engine.model_identity(),
                             engine_config=engine.capture_engine_config(),
                             environment=current_environment(device=opts.engine.runner.device))
        extra = {} if opts.flush_interval is None else {"flush_interval": opts.flush_interval}
        writer = ProcessCaptureWriter(opts.out, header, overwrite=opts.overwrite, **extra)
        engine.listeners.append(CaptureTap(writer))
    t = time.perf_counter()
    try:
        steps, prompt_tokens, generated = run_engine(engine, opts.requests, opts.progress)
    except BaseException as e:
        if writer is not None:
            writer.close(status=f"error: {type(e).__name__}: {e}"[:500])
        raise
    wall = time.perf_counter() - t
    size = 0
    if writer is not None:
        writer.close()
        size = opts.out.stat().st_size
    return RecordResult(str(opts.out), steps, len(opts.requests), prompt_tokens, generated, round(wall, 3),
                        round((prompt_tokens + generated) / wall, 1) if wall > 0 else 0.0, size)


def _version() -> str:
    from replay import __version__

    return __version__
