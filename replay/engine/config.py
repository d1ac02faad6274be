"""Configuration of the builtin engine: one dataclass per concern, the names vLLM uses for the same knobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from replay.errors import UsageError

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")  # vLLM's `logprobs_mode`

DTYPES = ("float32", "bfloat16", "float16", "float64")  # float64: the "which side is closer to the truth" re-run
# batched (one call per layer for the short requests; the default) | sdpa (one call per request: batch-invariant,
# the golden captures' choice) | reference (plain math per request, float64 softmax); engine/attention.py
ATTENTION_IMPLS = ("batched", "sdpa", "reference")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama-family decoder, as read from a Hugging Face `config.json` (or the builtin `tiny`)."""

    architecture: str  # LlamaForCausalLM | MistralForCausalLM | Qwen2ForCausalLM | Qwen3ForCausalLM
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    sliding_window: int | None = None  # Mistral: attention window (None = full)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's knobs (vLLM's `SchedulerConfig` + `CacheConfig` names)."""

    block_size: int = 16
    num_gpu_blocks: int = 512  # KV blocks in the pool
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512  # token budget per step; longer prefills are chunked
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """The model runner's numerics knobs (each one can change bits; all are recorded in the capture header).
    Checked when made: a value the runner cannot honour is a UsageError naming the knob."""

    dtype: str = "float32"  # one of DTYPES
    device: str = "cpu"
    attention_impl: str = "batched"  # one of ATTENTION_IMPLS (the batch-invariant mode attends per token whatever)
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    batch_invariant: bool = False
    seed: int = 0  # engine seed: draws the seeds of unseeded requests
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UsageError(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise UsageError(f"attention {self.attention_impl!r}: expected one of {', '.join(ATTENTION_IMPLS)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise UsageError(f"threads {self.num_threads}: expected a positive integer")
        if self.seed < 0:
            raise UsageError(f"seed {self.seed}: expected a non-negative integer")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise UsageError(f"logprobs mode {self.logprobs_mode!r}: expected one of {', '.join(LOGPROBS_MODES)}")
        if self.device != "cpu":
            problem = device_problem(self.device)
            if problem:
                raise UsageError(f"device {self.device!r}: {problem}")


def device_problem(device: str) -> str | None:
    """Why the builtin engine cannot run on `device` in this process (None when it can)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return "not a device name (cpu, cuda, cuda:1, ...)"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return "the builtin engine runs on cpu or cuda"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"no CUDA device here (torch {torch.__version__}, {build})"
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"there are {torch.cuda.device_count()} CUDA device(s)"
    return None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything needed to build the builtin engine."""

    model: str = "tiny"  # "tiny" or a local checkpoint directory
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
