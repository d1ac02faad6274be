"""`SamplingParams`: mirrors `vllm/sampling_params.py` for every field that changes sampling or outputs."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from replay.contracts.arrays import Opaque

# vLLM: _SAMPLING_EPS; below this temperature a request is greedy and top-p/top-k/min-p are reset.
SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """vLLM's `RequestOutputKind`: how outputs are streamed to the client."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    """vLLM's `SamplingType`: which sampler path (and which generator) a request takes."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Sampling parameters of one request. Map form with defaults omitted, as vLLM's own msgspec Struct."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = whole vocabulary
    min_p: float = 0.0
    seed: int | None = None  # set -> per-request torch.Generator, independent of batch composition
    stop: list[str] | None = None  # vLLM: str | list[str]; a single str is stored as a one-element list
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per sampled token; -1 = whole vocabulary
    prompt_logprobs: int | None = None  # -1 = whole vocabulary
    logprob_token_ids: list[int] | None = None  # extra token ids whose logprobs are always returned
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: dict[str, Any] | None = None  # vLLM: StructuredOutputsParams, kept as its field dict
    logit_bias: dict[int, float] | None = None  # token id -> bias added to the logit
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: Opaque | None = None  # vLLM: RepetitionDetectionParams
    routed_experts_prompt_start: int = 0
    # vLLM keeps these private (leading underscore); they decide when a request stops, so replay needs them.
    eos_token_id: int | None = None  # vLLM: _eos_token_id
    all_stop_token_ids: list[int] | None = None  # vLLM: _all_stop_token_ids (stop_token_ids + eos)
    bad_words_token_ids: list[list[int]] | None = None  # vLLM: _bad_words_token_ids

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY below SAMPLING_EPS, else RANDOM_SEED when seeded, else RANDOM (vLLM's cached property)."""
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def num_logprobs(self) -> int | None:
        """Top-k logprobs asked for: `logprobs`, or the number of `logprob_token_ids`."""
        if self.logprobs is not None:
            return self.logprobs
        return len(self.logprob_token_ids) if self.logprob_token_ids else None
