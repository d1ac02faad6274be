"""Mirrors `vllm/v1/core/sched/output.py` (vLLM 0.32): what the scheduler hands the model runner each step.

A `SchedulerOutput` is a *diff* against the runner's cached per-request state (DESIGN §4), which is why replay
must start from an empty runner at a clean step boundary and apply steps in order. vLLM declares these as
dataclasses; ours are array-like msgspec Structs (same field names and order) so a step costs few bytes.
"""

from __future__ import annotations

from typing import Generic

import msgspec

from replay.contracts.arrays import Array, Opaque
from replay.contracts.reqid import RID
from replay.contracts.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, Generic[RID], array_like=True, omit_defaults=True, gc=False):
    """A request scheduled for the first time: the worker caches all of this."""

    req_id: RID
    prompt_token_ids: list[int] | None  # [num_prompt_tokens]; None for prompt-embeds-only requests
    mm_features: list[Opaque]  # vLLM: list[MultiModalFeatureSpec]; Opaque, we never replay multimodal inputs
    sampling_params: SamplingParams | None
    pooling_params: Opaque | None  # vLLM: PoolingParams; pooling models are not replayed
    block_ids: tuple[list[int], ...]  # [num_kv_cache_groups][num_blocks]
    num_computed_tokens: int  # > 0 on a prefix-cache hit: those tokens' K/V are already in the blocks
    lora_request: Opaque | None  # vLLM: LoRARequest
    prompt_embeds: Array | None = None  # [num_prompt_tokens, hidden_size]
    prompt_is_token_ids: list[bool] | None = None  # [num_prompt_tokens]; mixed token/embeds prompts only
    prefill_token_ids: list[int] | None = None  # Model Runner V2 only: all tokens of a resumed request
    replay_start: int = 0  # vLLM 0.32: SWA/MLA "bounded replay" start; unrelated to this tool


class CachedRequestData(msgspec.Struct, Generic[RID], array_like=True, omit_defaults=True, gc=False):
    """Diffs for requests the worker already caches. All lists are parallel to `req_ids`."""

    req_ids: list[RID]  # [num_reqs]
    # For these ids `new_block_ids` REPLACES the block table (preempted and back); for the others it is appended.
    resumed_req_ids: set[RID]
    new_token_ids: list[list[int]]  # [num_reqs][num_new_tokens]; only with pipeline parallelism, else []
    all_token_ids: dict[RID, list[int]]  # req_id -> all tokens, for requests not scheduled in the previous step
    new_block_ids: list[tuple[list[int], ...] | None]  # [num_reqs][num_kv_cache_groups][num_new_blocks]
    num_computed_tokens: list[int]  # [num_reqs]
    num_output_tokens: list[int]  # [num_reqs]; num_output_tokens + num_output_placeholders

    @property
    def num_reqs(self) -> int:
        """Number of cached requests scheduled this step."""
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> "CachedRequestData":
        """An instance with no requests (vLLM's `make_empty`)."""
        return cls([], set(), [], {}, [], [], [])


class SchedulerOutput(msgspec.Struct, Generic[RID], array_like=True, omit_defaults=True, gc=False):
    """Everything the model runner needs for one step."""

    scheduled_new_reqs: list[NewRequestData[RID]]
    scheduled_cached_reqs: CachedRequestData[RID]
    num_scheduled_tokens: dict[RID, int]  # req_id -> num_scheduled_tokens (spec tokens included)
    total_num_scheduled_tokens: int  # == sum(num_scheduled_tokens.values())
    scheduled_spec_decode_tokens: dict[RID, list[int]]  # req_id -> spec_token_ids; absent if none
    scheduled_encoder_inputs: dict[RID, list[int]]  # req_id -> encoder input indices to process this step
    finished_req_ids: set[RID]  # finished between the previous and this step: the worker frees their state
    free_encoder_mm_hashes: list[str]  # mm hashes whose encoder outputs can be freed
    scheduled_encoder_input_stats: Opaque | None = None  # vLLM: ScheduledEncoderInputStats
    preempted_req_ids: set[RID] | None = None  # Model Runner V2 only
    has_structured_output_requests: bool = False  # set only with async scheduling
    pending_structured_output_tokens: bool = False
    num_invalid_spec_tokens: dict[RID, int] | None = None  # req_id -> rejected spec tokens
    kv_connector_metadata: Opaque | None = None  # vLLM: KVConnectorMetadata
    has_sync_kv_loads: bool = False
    aux_output_connector_metadata: Opaque | None = None
    ec_connector_metadata: Opaque | None = None  # vLLM: ECConnectorMetadata
    ec_manager_metadata: Opaque | None = None  # vLLM: EncoderCacheManagerMetadata
    new_block_ids_to_zero: list[int] | None = None  # the worker zeroes these KV blocks before use
    kv_cache_block_copies: list[Opaque] | None = None
    kv_connector_block_state: Opaque | None = None  # vLLM: KVConnectorBlockState
    num_spec_tokens_to_schedule: int = 0
    num_common_prefix_blocks: list[int] = []  # [num_kv_cache_groups]; cascade attention

    @classmethod
    def make_empty(cls) -> "SchedulerOutput":
        """A step that schedules nothing (vLLM's `make_empty`)."""
        return cls([], CachedRequestData.make_empty(), {}, 0, {}, {}, set(), [])

    def scheduled_req_ids(self) -> list[RID]:
        """Ids of every request scheduled this step: new ones first, then cached, as the runner adds them."""
        return [r.req_id for r in self.scheduled_new_reqs] + list(self.scheduled_cached_reqs.req_ids)


class GrammarOutput(msgspec.Struct, Generic[RID], array_like=True, omit_defaults=True, gc=False):
    """Structured-output bitmasks the scheduler hands to `sample_tokens` (vLLM 0.32)."""

    structured_output_request_ids: list[RID]  # [num_structured_reqs]
    grammar_bitmask: Array  # [num_structured_reqs, ceil(vocab_size / 32)] int32, rows ordered like the ids
    # [num_structured_reqs]: leading drafts per request the bitmask constrained (spec decode); None: no draft valid
    num_acceptable_drafts: list[int] | None = None
