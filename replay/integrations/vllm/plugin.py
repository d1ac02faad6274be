"""The `vllm.general_plugins` entry point: taps vLLM's scheduler into a capture when `REPLAY_CAPTURE` is set.

    REPLAY_CAPTURE=/path/run.capture vllm serve ...        # or any program that builds a vLLM engine

vLLM loads general plugins in every process it starts (front end, EngineCore, workers); the tap patches the
`Scheduler` class, so it records in whichever process hosts the scheduler, in-process or multiprocess. For each
step it converts the `SchedulerOutput` right as `schedule()` returns it (later code may mutate it) and pairs it by
identity with the `ModelRunnerOutput` given to `update_from_output` (with async scheduling the two calls
interleave). Request arrivals and aborts are recorded with the step they precede. Encoding is the only work on the
engine thread; a writer process does the rest. Inert unless `REPLAY_CAPTURE` names a path.
"""

from __future__ import annotations

import atexit
import os
import time

ENV = "REPLAY_CAPTURE"
_state: dict = {}


def register() -> None:
    """Entry point: patch vLLM's Scheduler when REPLAY_CAPTURE is set (once per process)."""
    path = os.environ.get(ENV)
    if not path or _state.get("patched"):
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    _state["patched"] = True
    orig_schedule, orig_update = Scheduler.schedule, Scheduler.update_from_output
    orig_add, orig_finish = Scheduler.add_request, Scheduler.finish_requests

    def schedule(self, *args, **kwargs):
        so = orig_schedule(self, *args, **kwargs)
        tap = _tap(self, path)
        tap.pending[id(so)] = tap.convert_so(so)
        return so

    def update_from_output(self, scheduler_output, model_runner_output):
        tap = _tap(self, path)
        so = tap.pending.pop(id(scheduler_output), None)
        if so is not None:
            tap.write_step(so, model_runner_output)
        return orig_update(self, scheduler_output, model_runner_output)

    def add_request(self, request, *args, **kwargs):
        _tap(self, path).add_request(request)
        return orig_add(self, request, *args, **kwargs)

    def finish_requests(self, request_ids, finished_status, *args, **kwargs):
        from vllm.v1.request import RequestStatus

        if finished_status == RequestStatus.FINISHED_ABORTED:
            tap = _tap(self, path)
            for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids or ()):
                tap.writer.abort_request(rid, tap.step)
        return orig_finish(self, request_ids, finished_status, *args, **kwargs)

    Scheduler.schedule, Scheduler.update_from_output = schedule, update_from_output
    Scheduler.add_request, Scheduler.finish_requests = add_request, finish_requests


class _Tap:
    """One capture per scheduler."""

    def __init__(self, scheduler, path: str):
        from replay.capture.writer_process import ProcessCaptureWriter
        from replay.integrations.vllm.convert import Converter

        self.conv = Converter()
        self.pending: dict[int, object] = {}
        self.step = 0
        self.writer = ProcessCaptureWriter(path, _header(scheduler), overwrite=True)
        atexit.register(self.close)

    def convert_so(self, so):
        from replay.contracts import SchedulerOutput

        return self.conv.convert(so, SchedulerOutput[str])

    def write_step(self, so, mro) -> None:
        from replay.contracts import ModelRunnerOutput

        self.writer.write_step(self.step, so, self.conv.convert(mro, ModelRunnerOutput[str]))
        self.step += 1

    def add_request(self, request) -> None:
        from replay.contracts import EngineCoreRequest

        self.writer.add_request(self.conv.convert(request, EngineCoreRequest), self.step)

    def close(self) -> None:
        """Footer and index at interpreter exit (a crash leaves a recoverable .partial instead)."""
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - never fail vLLM's shutdown because of the tap
            pass


def _tap(scheduler, path: str) -> _Tap:
    tap = getattr(scheduler, "_replay_tap", None)
    if tap is None:
        tap = scheduler._replay_tap = _Tap(scheduler, path)
    return tap


def _header(sched):
    """Everything replay needs to rebuild an equivalent engine, from the scheduler's vllm_config."""
    import vllm

    from replay.capture import EngineConfig, ModelIdentity
    from replay.environment import current_environment, make_header

    vc = sched.vllm_config
    mc, cc, sc = vc.model_config, vc.cache_config, vc.scheduler_config
    dtype = str(mc.dtype).replace("torch.", "")
    path = str(mc.model)
    fingerprint = ""
    if os.environ.get("REPLAY_FINGERPRINT", "1") != "0" and os.path.isdir(path):
        try:
            from replay.engine.weights import checkpoint_fingerprint

            fingerprint = checkpoint_fingerprint(path)
        except Exception:  # noqa: BLE001 - a fingerprint is provenance, not a reason to stop serving
            fingerprint = ""
    arch = (getattr(mc.hf_config, "architectures", None) or [""])[0]
    model = ModelIdentity(name=path, architecture=arch, fingerprint=fingerprint, dtype=dtype, path=path)
    num_blocks = getattr(getattr(sched, "kv_cache_config", None), "num_blocks", 0) or 0
    ec = EngineConfig(
        block_size=cc.block_size, num_gpu_blocks=int(num_blocks), max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens, max_model_len=mc.max_model_len,
        enable_prefix_caching=bool(cc.enable_prefix_caching), enable_chunked_prefill=bool(sc.enable_chunked_prefill),
        attention_impl=str(getattr(getattr(vc, "attention_config", None), "backend", "") or ""), seed=mc.seed,
        logprobs_mode=str(getattr(mc, "logprobs_mode", "raw_logprobs")),
        async_scheduling=bool(getattr(sc, "async_scheduling", False)),
        runner_class="vllm.v1.worker.gpu_model_runner.GPUModelRunner",
        extra={"vllm_config": str(vc)[:4000]})
    return make_header("vllm", engine_version=vllm.__version__, model=model, engine_config=ec,
                       environment=current_environment(device=str(getattr(vc.device_config, "device", "cpu"))),
                       extra={"recorded_at": time.time()})
