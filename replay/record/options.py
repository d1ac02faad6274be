"""`EngineOptions`: the engine knobs a user gave `replay record` (None: not given), and the one place that turns
them into an engine configuration. The builtin engine's defaults are its config dataclasses' own
(`replay.engine.config`); vLLM's are vLLM's. Nothing else picks a default."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.errors import UsageError

ENGINES = ("builtin", "vllm")


@dataclass(slots=True)
class EngineOptions:
    """Which engine to record, and the knobs the user set (vLLM's names where vLLM has the knob)."""

    engine: str = "builtin"  # builtin | vllm
    model: str = "tiny"  # "tiny" (builtin only) or a local checkpoint directory
    dtype: str | None = None
    seed: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    num_blocks: int | None = None  # KV blocks (vLLM: num_gpu_blocks_override)
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None
    vllm_args: dict[str, object] = field(default_factory=dict)  # vLLM only: any EngineArgs field, by vLLM's name
    # builtin engine only
    device: str | None = None
    attention: str | None = None
    threads: int | None = None
    batch_invariant: bool | None = None

    def check(self) -> None:
        """Refuse what the chosen engine cannot take, in one line."""
        if self.engine not in ENGINES:
            raise UsageError(f"--engine {self.engine!r}: expected builtin or vllm")
        if self.engine == "vllm":
            builtin_only = {"--device": self.device, "--attention": self.attention, "--threads": self.threads,
                            "--batch-invariant": self.batch_invariant or None}
            given = [k for k, v in builtin_only.items() if v is not None]
            if given:
                raise UsageError(f"{', '.join(given)}: builtin engine only (vLLM picks its own device and kernels)")
            if self.model == "tiny":
                raise UsageError("--engine vllm needs --model PATH, a local checkpoint directory "
                                 "('tiny' is builtin only)")
        elif self.vllm_args:
            raise UsageError(f"--vllm-arg {next(iter(self.vllm_args))}: vLLM engine only (--engine vllm)")


def parse_vllm_args(items: list[str] | None) -> dict[str, object]:
    """`["gpu_memory_utilization=0.5", "enforce_eager=false"]` -> {"gpu_memory_utilization": 0.5, ...}: values are
    read as JSON where they parse (numbers, true/false, null, lists), else kept as strings."""
    out: dict[str, object] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise UsageError(f"--vllm-arg {item!r}: expected NAME=VALUE (vLLM's engine argument names)")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _given(defaults: object, **values: object) -> object:
    """`defaults` with every value that is not None put in."""
    return dataclasses.replace(defaults, **{k: v for k, v in values.items() if v is not None})


def builtin_config(opts: EngineOptions) -> EngineConfig:
    """The builtin engine's configuration: what `opts` sets, the engine's own defaults for the rest."""
    scheduler = _given(SchedulerConfig(), block_size=opts.block_size, num_gpu_blocks=opts.num_blocks,
                       max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=opts.max_num_batched_tokens,
                       max_model_len=opts.max_model_len, enable_prefix_caching=opts.enable_prefix_caching)
    runner = _given(RunnerConfig(), dtype=opts.dtype, device=opts.device, attention_impl=opts.attention,
                    num_threads=opts.threads, seed=opts.seed, batch_invariant=opts.batch_invariant)
    return EngineConfig(model=opts.model, scheduler=scheduler, runner=runner)
