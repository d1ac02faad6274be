"""Configuration of the builtin engine: one dataclass per concern, the names vLLM uses for the same knobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    """The model runner's numerics knobs (each one can change bits; all are recorded in the capture header)."""

    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"
    attention_impl: str = "sdpa"  # sdpa (fast) | reference (plain math, float64 softmax)
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    batch_invariant: bool = False
    seed: int = 0  # engine seed: draws the seeds of unseeded requests
    logprobs_mode: str = "raw_logprobs"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything needed to build the builtin engine."""

    model: str = "tiny"  # "tiny" or a local checkpoint directory
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
