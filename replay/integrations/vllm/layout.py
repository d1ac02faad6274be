"""The recorded parallel layout and compilation, as the keyword arguments of vLLM's `LLM` (for replay on vLLM's own
runner), and the `--set` knobs that change them, by vLLM's names.

The layout is read from the capture header's `engine_config.layout` (see `header.vllm_layout`); a knob given with
`--set` wins. Captures recorded before layouts were recorded (and builtin captures) replay as they always did:
one worker, eager.
"""

from __future__ import annotations

import json
import os

from replay.capture import EngineConfig

# `--set` knobs of vLLM-runner replay that change the layout (vLLM's EngineArgs names)
LAYOUT_KNOBS = ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend", "enforce_eager",
                "compilation_mode", "attention_backend")
EXECUTOR_BACKENDS = ("mp", "ray", "uni", "external_launcher")
COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")  # vLLM's CompilationMode
_TRUE = ("1", "true", "yes", "on")
ENGINE_ARG = "vllm."  # `--set vllm.ARG=VALUE`: any engine argument, by vLLM's name


def engine_args(overrides: dict[str, str]) -> dict[str, str]:
    """The `vllm.ARG` knobs among `overrides`, by vLLM's argument name (their values as given)."""
    return {k[len(ENGINE_ARG):]: v for k, v in overrides.items() if k.startswith(ENGINE_ARG)}


def check_layout_knob(key: str, value: str) -> str:
    """`value` of layout knob `key`, normalised (compilation modes by name); ValueError saying what it expects."""
    if key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if not (value.isdigit() and int(value) >= 1):
            raise ValueError("expected a positive integer")
        return str(int(value))
    if key == "distributed_executor_backend":
        if value not in EXECUTOR_BACKENDS:
            raise ValueError(f"expected one of {', '.join(EXECUTOR_BACKENDS)}")
        return value
    if key == "compilation_mode":
        if value.isdigit() and int(value) < len(COMPILATION_MODES):
            return COMPILATION_MODES[int(value)]
        if value.upper() not in COMPILATION_MODES:
            raise ValueError(f"expected one of {', '.join(COMPILATION_MODES)} (or 0-3)")
        return value.upper()
    return value


def recorded_layout(ec: EngineConfig, overrides: dict[str, str], engine: str = "vllm") -> dict[str, str]:
    """The layout to replay on: the recorded one (vLLM's names, as text), with the `--set` layout knobs applied.
    `engine`: who recorded it (the builtin engine's attention implementations are not vLLM backends)."""
    layout = dict(ec.layout)
    layout.pop("attention_backend", None)  # the backend vLLM selected; asked for only when the recording asked
    if ec.attention_impl and engine == "vllm":
        layout["attention_backend"] = ec.attention_impl
    layout.update({k: v for k, v in overrides.items() if k in LAYOUT_KNOBS})
    return layout


def engine_layout_kwargs(ec: EngineConfig, overrides: dict[str, str], engine: str = "vllm") -> dict:
    """`LLM(...)` keyword arguments for the recorded layout: TP and PP sizes, the executor backend when there is
    more than one worker (or it is asked for), eager or the recorded compilation mode (and cudagraph mode), and the
    attention backend when the recording (or `--set`) named one, the speculative config (`header.speculative_args`)
    and the LoRA settings."""
    layout = recorded_layout(ec, overrides, engine)
    tp = int(layout.get("tensor_parallel_size", 1))
    pp = int(layout.get("pipeline_parallel_size", 1))
    out: dict = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                 "enforce_eager": str(layout.get("enforce_eager", "True")).lower() in _TRUE}
    backend = layout.get("distributed_executor_backend")
    if backend and (tp * pp > 1 or "distributed_executor_backend" in overrides):
        out["distributed_executor_backend"] = backend
    mode = layout.get("compilation_mode")
    if mode and not out["enforce_eager"]:
        compilation: dict = {"mode": COMPILATION_MODES.index(mode) if mode in COMPILATION_MODES else mode}
        if layout.get("cudagraph_mode"):
            compilation["cudagraph_mode"] = layout["cudagraph_mode"]
        out["compilation_config"] = compilation
    if layout.get("attention_backend"):
        out["attention_backend"] = layout["attention_backend"]
    if layout.get("speculative_args"):  # vLLM verifies drafts only with one; the replay's own proposals go unused
        out["speculative_config"] = json.loads(layout["speculative_args"])  # (each step verifies the recorded ones)
    for flag in ("use_fp64_gumbel", "enable_return_routed_experts"):  # the seeded draws replay only with the first;
        if str(layout.get(flag, "")).lower() in _TRUE:  # the MoE routing is compared only with the second
            out[flag] = True
    if layout.get("max_lora_rank"):  # recorded with LoRA enabled: adapters are re-attached per request
        out.update(enable_lora=True, max_lora_rank=int(layout["max_lora_rank"]),
                   max_loras=int(layout.get("max_loras") or 1))
    return out


def omp_threads_bind(layout: dict, env: dict[str, str], device: str) -> str | None:
    """`VLLM_CPU_OMP_THREADS_BIND` for a CPU engine of more than one worker, unless the user set it: the recording's
    value when it recorded one and every CPU it names is ours, else this process's CPUs split evenly per worker."""
    world = int(layout.get("tensor_parallel_size", 1)) * int(layout.get("pipeline_parallel_size", 1))
    if world <= 1 or not device.startswith("cpu") or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return None
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cpus = list(range(os.cpu_count() or 1))
    recorded = env.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if recorded and recorded not in ("auto", "nobind") and _cpus_of(recorded) <= set(cpus):
        return recorded
    if len(cpus) < world:
        return None  # vLLM says why it cannot start, in its own words
    per = len(cpus) // world
    groups = [cpus[i * per:(i + 1) * per] for i in range(world)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def _cpus_of(bind: str) -> set[int]:
    """"0-3|4,6" -> {0, 1, 2, 3, 4, 6}; an unreadable value names no CPU we have."""
    out: set[int] = set()
    try:
        for part in bind.replace("|", ",").split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return {-1}
    return out
