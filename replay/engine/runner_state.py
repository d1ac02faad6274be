"""What the builtin runner keeps between steps: per request (`CachedRequestState`, vLLM's), and the snapshots a bisect
takes of it (`StepSnapshot`, `RunnerSnapshot`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from replay.contracts import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps per request between steps (vLLM's `CachedRequestState`)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: tuple[int, ...] = ()
    prompt_logprobs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)  # chunks so far
    lora: str | None = None  # the LoRA adapter (by name) its tokens go through, if any

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens known to the runner."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token(self, i: int) -> int:
        """The i-th token of prompt + output."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]


@dataclass(slots=True)
class StepSnapshot:
    """The part of the runner's state one step can change."""

    slots: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    requests: dict[str, tuple[int, int, torch.Tensor | None, list]]
    last_emitted: dict[str, int]  # tokens each request emitted in the step before (forced mode replaces that many)


@dataclass(slots=True)
class RunnerSnapshot:
    """The whole runner state between two steps."""

    k: list[torch.Tensor] | None  # None: a runner that holds no request, whose KV blocks restore as zeros
    v: list[torch.Tensor] | None
    requests: dict[str, tuple]
    batch: list[str]
    seed_gen: torch.Tensor
    last_emitted: dict[str, int]
