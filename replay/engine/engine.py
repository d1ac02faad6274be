"""`LLMEngine`: the builtin engine's step loop (vLLM's `EngineCore.step`): schedule -> execute -> update.

Every step the engine runs is handed to its listeners (a `CaptureTap` when recording), including steps that
schedule no token but report finished requests: the runner's state depends on those too.
"""

from __future__ import annotations

import itertools
import os
import time

from replay.capture import EngineConfig as CaptureEngineConfig
from replay.capture import Header, ModelIdentity, StepTiming
from replay.contracts import EngineCoreOutputs, EngineCoreRequest, SamplingParams
from replay.engine.config import EngineConfig, ModelConfig
from replay.engine.model_runner import ModelRunner
from replay.engine.scheduler import Scheduler
from replay.engine.weights import load_model, torch_dtype
from replay.errors import UsageError
from replay.provenance import (
    current_environment,
    make_header,
    pin_threading,
    set_torch_threads,
)

# How every capture names this runner: an identity that replays compare, so it stays as it is when modules move.
RUNNER_CLASS = "replay.engine.runner.ModelRunner"


class LLMEngine:
    """Scheduler + model runner + listeners, driven one step at a time."""

    def __init__(self, config: EngineConfig, listeners: list | None = None):
        rc = config.runner
        pin_threading()  # exactly the threads torch has, in every library: see pin_threading
        if rc.num_threads:
            set_torch_threads(rc.num_threads)
        torch_dtype(rc.dtype)
        self.config = config
        self.model, self.model_config, self.fingerprint = load_model(config.model, rc.dtype, rc.device)
        eos = self.model_config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) and eos else (eos if isinstance(eos, int) else None)
        sc = config.scheduler
        self.scheduler = Scheduler(sc, eos_token_id=self.eos_token_id)
        self.runner = ModelRunner(self.model, sc.num_gpu_blocks, sc.block_size, attention_impl=rc.attention_impl,
                                  seed=rc.seed, eos_token_id=self.eos_token_id, batch_invariant=rc.batch_invariant,
                                  logprobs_mode=rc.logprobs_mode)
        self.listeners = list(listeners or [])
        self.step_index = 0
        self._ids = itertools.count()

    # -- requests ----------------------------------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; returns its internal id (`request_id` is kept as the external id)."""
        n = next(self._ids)
        ext = request_id if request_id is not None else str(n)
        rid = f"{ext}-{n:06d}" if request_id is not None else ext
        sp = params or SamplingParams()
        if not prompt_token_ids:
            raise UsageError(f"request {ext!r}: empty prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise UsageError(f"request {ext!r}: token id {bad[0]} outside the model's vocabulary of "
                             f"{self.model_config.vocab_size}")
        ecr = EngineCoreRequest(rid, list(prompt_token_ids), None, sp, None,
                                time.time() if arrival_time is None else arrival_time, None, None, None,
                                external_req_id=ext)
        self.add_engine_core_request(ecr)
        return rid

    def add_engine_core_request(self, ecr: EngineCoreRequest) -> None:
        """Queue a request built elsewhere (same fields as vLLM's)."""
        try:
            if ecr.sampling_params is not None:
                check_logprob_token_ids(ecr.sampling_params, self.model_config.vocab_size)
            self.scheduler.add_request(ecr)
        except ValueError as e:  # the scheduler's refusal of an impossible request is the user's input error
            raise UsageError(f"request {ecr.name!r}: {e}") from None
        for listener in self.listeners:
            listener.on_request_added(ecr, self.step_index)

    def abort_request(self, request_id: str) -> None:
        """Abort a request; its id is reported in the next step's finished_req_ids."""
        self.scheduler.abort_requests([request_id])
        for listener in self.listeners:
            listener.on_request_aborted(request_id, self.step_index)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs, or has a finish still to report."""
        return self.scheduler.has_requests()

    # -- the step ------------------------------------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """One schedule -> execute -> update cycle."""
        t0 = time.monotonic_ns()
        so = self.scheduler.schedule()
        t1 = time.monotonic_ns()
        try:
            mro = self.runner.execute_model(so)
        except Exception as e:
            for listener in self.listeners:
                listener.on_step_failed(self.step_index, so, e)
            raise
        t2 = time.monotonic_ns()
        outputs = self.scheduler.update_from_output(so, mro)
        t3 = time.monotonic_ns()
        timing = StepTiming(t0, t1 - t0, t2 - t1, t3 - t2)
        for listener in self.listeners:
            listener.on_step(self.step_index, so, mro, drawn_seeds=self.runner.last_drawn_seeds, timing=timing)
        self.step_index += 1
        return outputs

    # -- provenance
    # ------------------------------------------------------------------------------------------------------

    def header(self) -> Header:
        """The capture header of a recording of this engine."""
        return builtin_header(self.config, self.model_config, self.fingerprint)


# vLLM: MAX_LOGPROB_TOKEN_IDS, the longest `logprob_token_ids` its sampler takes
MAX_LOGPROB_TOKEN_IDS = 128


def check_logprob_token_ids(sp: SamplingParams, vocab_size: int) -> None:
    """Refuse `logprob_token_ids` as vLLM's `SamplingParams.verify` does (ValueError): too many, out of the
    vocabulary (the sampler would index past its logprobs), or beside a `logprobs` of another count."""
    ids = sp.logprob_token_ids
    if ids is None:
        return
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise ValueError(f"{len(ids)} logprob_token_ids, more than the {MAX_LOGPROB_TOKEN_IDS} allowed")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"logprob_token_ids {bad} outside the model's vocabulary of {vocab_size}")
    if sp.logprobs is not None and sp.logprobs != len(ids):
        raise ValueError(f"logprobs={sp.logprobs} beside {len(ids)} logprob_token_ids: vLLM wants them equal")


def builtin_header(config: EngineConfig, model_config: ModelConfig, fingerprint: str) -> Header:
    """What a capture header says about a builtin engine (or runner) built from `config`: the model, the engine
    configuration and this process's environment. Recording and replay describe themselves with it, so that
    `replay.provenance.header_differences` compares like with like."""
    import dataclasses

    from replay import __version__

    sc, rc = config.scheduler, config.runner
    model = ModelIdentity(name=config.model, architecture=model_config.architecture, fingerprint=fingerprint,
                          dtype=rc.dtype, path="" if config.model == "tiny" else os.path.abspath(config.model),
                          config=dataclasses.asdict(model_config))
    engine_config = CaptureEngineConfig(
        block_size=sc.block_size, num_gpu_blocks=sc.num_gpu_blocks, max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens, max_model_len=sc.max_model_len,
        enable_prefix_caching=sc.enable_prefix_caching, enable_chunked_prefill=sc.enable_chunked_prefill,
        attention_impl=rc.attention_impl, seed=rc.seed, logprobs_mode=rc.logprobs_mode,
        runner_class=RUNNER_CLASS, batch_invariant=rc.batch_invariant,
        extra={"device": rc.device, "dtype": rc.dtype},
        layout={"tensor_parallel_size": "1", "pipeline_parallel_size": "1", "data_parallel_size": "1"})
    return make_header("builtin", engine_version=__version__, model=model, engine_config=engine_config,
                       environment=current_environment(device=rc.device))
