"""Taps the builtin engine's step loop and streams it into a capture (the vLLM engine has its own tap, the
plugin in `replay.integrations.vllm`).

An engine calls three hooks: `on_request_added` when a request arrives, `on_request_aborted` when a client aborts
one, and `on_step` after each step with the exact `SchedulerOutput` the runner consumed and the
`ModelRunnerOutput` it produced. Encoding happens here, on the engine thread, before the engine can touch the
objects again; compression and I/O happen on the writer's background thread (zstd and file writes release the GIL).
"""

from __future__ import annotations

import time
from typing import Protocol

from replay.capture import CaptureWriter, Crash, StepTiming
from replay.capture.writing.writer_process import ProcessCaptureWriter
from replay.contracts import EngineCoreRequest, ModelRunnerOutput, SchedulerOutput


class StepListener(Protocol):
    """What an engine calls; `CaptureTap` records, tests may count."""

    def on_request_added(self, request: EngineCoreRequest, step: int) -> None:
        """A request arrived before step `step`."""

    def on_request_aborted(self, request_id: str, step: int) -> None:
        """A client aborted a request before step `step`."""

    def on_step(self, index: int, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput | None,
                *, drawn_seeds: dict[str, int] | None = None, timing: StepTiming | None = None) -> None:
        """Step `index` ran: what went into the runner and what came out."""

    def on_step_failed(self, index: int, scheduler_output: SchedulerOutput, error: BaseException) -> None:
        """Step `index` was scheduled and raised `error` while executing (the engine re-raises it)."""


class CaptureTap:
    """A StepListener that writes everything to a capture writer (`CaptureWriter`, or `ProcessCaptureWriter`
    which keeps interning, compression and I/O off the engine's interpreter lock)."""

    def __init__(self, writer: CaptureWriter | ProcessCaptureWriter) -> None:
        self.writer = writer
        self.crash_status = ""  # the footer status once a step raised
        self.encode_ns = 0  # time spent on the engine thread, for the tap-overhead benchmark

    def on_request_added(self, request: EngineCoreRequest, step: int) -> None:
        """Record an arrival before step `step`."""
        self.writer.add_request(request, step)

    def on_request_aborted(self, request_id: str, step: int) -> None:
        """Record an abort before step `step`."""
        self.writer.abort_request(request_id, step)

    def on_step(self, index: int, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput | None,
                *, drawn_seeds: dict[str, int] | None = None, timing: StepTiming | None = None) -> None:
        """Record one step."""
        t = time.perf_counter_ns()
        self.writer.write_step(index, scheduler_output, model_runner_output, drawn_seeds=drawn_seeds or {},
                               timing=timing)
        self.encode_ns += time.perf_counter_ns() - t

    def on_step_failed(self, index: int, scheduler_output: SchedulerOutput, error: BaseException) -> None:
        """Record the crash: the exception, then the step that raised it (scheduled, no output)."""
        crash = Crash.from_exception(index, error)
        self.crash_status = crash.status()
        self.writer.write_crash(crash)
        self.writer.write_step(index, scheduler_output, None)
