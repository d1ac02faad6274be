"""`Request`: the engine-side state of one request (vLLM's `vllm/v1/request.py`, generation requests only).

The scheduler owns these. The model runner never sees them: it gets `NewRequestData` / `CachedRequestData` diffs
and keeps its own per-request cache, which is exactly why the scheduler must describe every change in its output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replay.contracts import (
    EngineCoreRequest,
    FinishReason,
    RequestStatus,
    SamplingParams,
)


@dataclass(slots=True)
class Request:
    """One generation request as the scheduler tracks it.

    `num_computed_tokens` counts tokens whose K/V are in the request's blocks (or will be, once the step that was
    just scheduled has run: the scheduler advances it right after `schedule()`, as vLLM does).
    """

    request_id: str  # internal id; unique per engine
    prompt_token_ids: list[int]  # [num_prompt_tokens]; never mutated
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None  # sampling_params.eos_token_id if set, else the model's
    external_req_id: str | None = None  # the user's id: compare requests across runs by this
    priority: int = 0
    client_index: int = 0
    cache_salt: str | None = None  # mixed into the first block's hash, so salted prompts share no cache
    max_tokens: int | None = None  # None: generate until max_model_len (vLLM fills max_model_len - prompt_len)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token that ended it (None for eos and length)
    output_token_ids: list[int] = field(default_factory=list)  # [num_output_tokens]
    all_token_ids: list[int] = field(default_factory=list)  # [num_tokens] = prompt + output
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Hashes of the full blocks of `all_token_ids`, chained from the first block. Filled lazily by the KV cache
    # manager (which knows the block size); a hash never changes once computed, since tokens are only appended.
    block_hashes: list[bytes] = field(default_factory=list)

    @classmethod
    def from_engine_core_request(cls, ecr: EngineCoreRequest, eos_token_id: int | None) -> Request:
        """Build the engine-side state of a request handed over by the frontend.

        Raises ValueError for what the builtin engine cannot run: prompt embeddings, pooling requests.
        """
        if ecr.prompt_token_ids is None:
            raise ValueError(f"request {ecr.request_id}: prompt embeddings are not supported, token ids are needed")
        if ecr.sampling_params is None:
            raise ValueError(f"request {ecr.request_id}: pooling requests are not supported, "
                             "sampling params are needed")
        sp = ecr.sampling_params
        prompt = list(ecr.prompt_token_ids)
        return cls(
            request_id=ecr.request_id,
            prompt_token_ids=prompt,
            sampling_params=sp,
            arrival_time=ecr.arrival_time,
            eos_token_id=sp.eos_token_id if sp.eos_token_id is not None else eos_token_id,
            external_req_id=ecr.external_req_id,
            priority=ecr.priority,
            client_index=ecr.client_index,
            cache_salt=ecr.cache_salt,
            max_tokens=sp.max_tokens,
            all_token_ids=list(prompt),  # a copy: outputs are appended to it, never to the prompt
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known so far."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far."""
        return len(self.output_token_ids)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """True when this request must not start from cached blocks.

        vLLM's `SamplingParams.__post_init__` defaults it to `prompt_logprobs is not None`: prompt logprobs need the
        logits of every prompt position, which a cache hit would skip computing.
        """
        sp = self.sampling_params
        if sp.skip_reading_prefix_cache is not None:
            return sp.skip_reading_prefix_cache
        return sp.prompt_logprobs is not None

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append sampled token(s) to the output and to all tokens."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        """True once the status is any FINISHED_*."""
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        """The FinishReason to report, or None while the request is not finished."""
        return RequestStatus.get_finished_reason(self.status)
