"""Mirrors `vllm/v1/core/sched/output.py` (vLLM 0.32): what the scheduler hands the model runner each step.

A `SchedulerOutput` is a *diff* against the runner's cached per-request state (docs/design.md, "Runner semantics"),
which is why replay must start from an empty runner at a clean step boundary and apply steps in order. vLLM declares
these as dataclasses; ours are array-like msgspec Structs (same field names and order) so a step costs few bytes.
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
    def make_empty(cls) -> CachedRequestData:
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
    def make_empty(cls) -> SchedulerOutput:
        """A step that schedules nothing (vLLM's `make_empty`)."""
        return cls([], CachedRequestData.make_empty(), {}, 0, {}, {}, set(), [])

    def scheduled_req_ids(self) -> list[RID]:
        """Ids of every request scheduled this step: new ones first, then cached, as the runner adds them."""
        return [r.req_id for r in self.scheduled_new_reqs] + list(self.scheduled_cached_reqs.req_ids)

    def without(self, req_ids: set[RID] | frozenset) -> SchedulerOutput[RID]:
        """This step with the requests `req_ids` taken out (scheduled, drafts, finished), as if never scheduled:
        a `--force` replay runs the rest of the batch. Structured-output bitmasks are the caller's to filter."""
        if not req_ids or not any(r in req_ids for r in self.num_scheduled_tokens) and \
                not (self.finished_req_ids & set(req_ids)):
            return self
        cr = self.scheduled_cached_reqs
        keep = [i for i, r in enumerate(cr.req_ids) if r not in req_ids]
        cached = CachedRequestData(
            [cr.req_ids[i] for i in keep], {r for r in cr.resumed_req_ids if r not in req_ids},
            [cr.new_token_ids[i] for i in keep] if cr.new_token_ids else [],
            {r: t for r, t in cr.all_token_ids.items() if r not in req_ids},
            [cr.new_block_ids[i] for i in keep], [cr.num_computed_tokens[i] for i in keep],
            [cr.num_output_tokens[i] for i in keep] if cr.num_output_tokens else [])
        scheduled = {r: n for r, n in self.num_scheduled_tokens.items() if r not in req_ids}
        return msgspec.structs.replace(
            self, scheduled_new_reqs=[n for n in self.scheduled_new_reqs if n.req_id not in req_ids],
            scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={r: t for r, t in self.scheduled_spec_decode_tokens.items()
                                          if r not in req_ids},
            scheduled_encoder_inputs={r: t for r, t in self.scheduled_encoder_inputs.items() if r not in req_ids},
            finished_req_ids=self.finished_req_ids - set(req_ids))

    def num_computed_before(self) -> dict[RID, int]:
        """req_id -> the tokens it had computed before this step: its first scheduled token's index."""
        cr = self.scheduled_cached_reqs
        out = {n.req_id: n.num_computed_tokens for n in self.scheduled_new_reqs}
        out.update(zip(cr.req_ids, cr.num_computed_tokens))
        return out

    def num_prefill_requests(self) -> int:
        """Requests scheduling prompt (or recomputed) tokens: new ones, and those scheduling more than one token
        beyond the draft tokens they verify (a decode with k drafts schedules 1 + k tokens)."""
        new = {r.req_id for r in self.scheduled_new_reqs}
        spec = self.scheduled_spec_decode_tokens
        return sum(1 for rid, n in self.num_scheduled_tokens.items() if rid in new or n - len(spec.get(rid, ())) > 1)


class GrammarOutput(msgspec.Struct, Generic[RID], array_like=True, omit_defaults=True, gc=False):
    """Structured-output bitmasks the scheduler hands to `sample_tokens` (vLLM 0.32)."""

    structured_output_request_ids: list[RID]  # [num_structured_reqs]
    grammar_bitmask: Array  # [num_structured_reqs, ceil(vocab_size / 32)] int32, rows ordered like the ids
    # [num_structured_reqs]: leading drafts per request the bitmask constrained (spec decode); None: no draft valid
    num_acceptable_drafts: list[int] | None = None

    def without(self, req_ids: set[RID] | frozenset, drafts: dict[RID, list[int]]) -> GrammarOutput[RID] | None:
        """These bitmasks with the rows of `req_ids` taken out (1 + its drafts rows per request, as vLLM lays them
        out); None when no structured request is left."""
        if not any(r in req_ids for r in self.structured_output_request_ids):
            return self
        rows, ids, acceptable, at = [], [], [], 0
        for i, rid in enumerate(self.structured_output_request_ids):
            n = 1 + len(drafts.get(rid, ()))
            if rid not in req_ids:
                rows.extend(range(at, at + n))
                ids.append(rid)
                if self.num_acceptable_drafts is not None:
                    acceptable.append(self.num_acceptable_drafts[i])
            at += n
        if not ids:
            return None
        mask = self.grammar_bitmask.to_numpy()[rows]
        return GrammarOutput(ids, Array.from_numpy(mask),
                             acceptable if self.num_acceptable_drafts is not None else None)
