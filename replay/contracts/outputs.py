"""Mirrors `vllm/v1/outputs.py` (vLLM 0.32): what the model runner hands back each step.

vLLM's `LogprobsLists` holds numpy arrays and `LogprobsTensors` torch tensors; both become packed `Array`s here so
float32 logprobs survive bit for bit. Column 0 of the logprob matrices is the sampled token, columns 1.. the
top-k (docs/design.md, "Runner semantics").
"""

from __future__ import annotations

from typing import Any, Generic

import msgspec
import numpy as np

from replay.contracts.arrays import Array, Opaque
from replay.contracts.reqid import RID


class LogprobsLists(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The CPU form the scheduler and frontend receive (a NamedTuple of numpy arrays in vLLM)."""

    logprob_token_ids: Array  # [num_reqs x num_generated_tokens, max_num_logprobs + 1] int32
    logprobs: Array  # [num_reqs x num_generated_tokens, max_num_logprobs + 1] float32
    sampled_token_ranks: Array  # [num_reqs x num_generated_tokens] int64 (int32 from tolists())
    # [num_reqs + 1] row offsets (0 first); only with spec decode, where a request emits a variable number of tokens
    cu_num_generated_tokens: list[int] | None = None

    @property
    def num_rows(self) -> int:
        """Rows = generated positions covered (one per request without spec decode)."""
        return self.logprob_token_ids.shape[0] if self.logprob_token_ids.shape else 0

    def rows_of(self, req_index: int) -> range:
        """Request `req_index`'s rows: one per token it generated this step, or one for a token the runner discarded
        (a partial prefill chunk's), as vLLM's `parse_output` counts them; without spec decode, row `req_index`."""
        cu = self.cu_num_generated_tokens
        if cu is not None and req_index + 1 < len(cu):
            return range(cu[req_index], cu[req_index + 1])
        return range(req_index, req_index + 1) if req_index < self.num_rows else range(0)

    def first_row(self, req_index: int) -> int:
        """The row of request `req_index`'s first generated token this step (vLLM's `slice_request`): its index
        without spec decode, its offset in `cu_num_generated_tokens` with it."""
        cu = self.cu_num_generated_tokens
        return cu[req_index] if cu is not None and req_index < len(cu) else req_index


class RoutedExpertsLists(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Which experts an MoE model routed each scheduled token to, one step (vLLM 0.29-0.30's `RoutedExpertsLists`,
    a NamedTuple of numpy arrays, with `enable_return_routed_experts`). Rows follow the step's scheduled tokens:
    the requests in `req_ids` order, each with its `num_scheduled_tokens` rows, its prompt's and its decodes'."""

    routing_data: Array  # [total_num_scheduled_tokens, num_moe_layers, top_k] int32: logical expert ids, router order
    slot_mapping: Array | None = None  # [total_num_scheduled_tokens] int64: each token's KV-cache slot

    def rows(self, req_ids: list, num_scheduled_tokens: dict) -> dict:
        """req_id -> its rows of `routing_data` [n, num_moe_layers, top_k]; {} when the rows are not one per
        scheduled token (another arrangement: nothing is paired rather than pairing the wrong rows)."""
        data = self.routing_data.to_numpy()
        counts = [int(num_scheduled_tokens.get(r, 0)) for r in req_ids]
        if data.ndim != 3 or data.shape[0] != sum(counts):
            return {}
        out, at = {}, 0
        for rid, n in zip(req_ids, counts):
            out[rid], at = data[at:at + n], at + n
        return out


class AuxRequestOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's MoE routing from vLLM's aux output connector (0.31 on, Model Runner V2 with
    `enable_return_routed_experts`): the rows its worker emitted this step, from token `token_start` on (tokens
    read back from prefix-cached blocks included)."""

    token_start: int  # the request's token index (prompt first) of rows[0]
    rows: Array  # [n, num_moe_layers, top_k] uint8 (uint16 past 256 experts): logical expert ids, router order


class LogprobsTensors(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The torch form (prompt logprobs, sampler output). Field names as vLLM's NamedTuple."""

    logprob_token_ids: Array  # [num_positions, num_logprobs + 1] int32
    logprobs: Array  # [num_positions, num_logprobs + 1] float32
    selected_token_ranks: Array  # [num_positions] int32
    cu_num_generated_tokens: list[int] | None = None

    def tolists(self, cu_num_generated_tokens: list[int] | None = None) -> LogprobsLists:
        """The same values as `LogprobsLists` (vLLM's `tolists`)."""
        return LogprobsLists(self.logprob_token_ids, self.logprobs, self.selected_token_ranks, cu_num_generated_tokens)


class SamplerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the sampler returns before the runner turns it into lists."""

    sampled_token_ids: Array  # [num_reqs, max_num_generated_tokens] int32, -1 (PLACEHOLDER_TOKEN_ID) padding
    logprobs_tensors: LogprobsTensors | None


class DraftTokenIds(msgspec.Struct, Generic[RID], array_like=True, omit_defaults=True, gc=False):
    """Speculative-decoding drafts proposed after a step."""

    req_ids: list[RID]  # [num_reqs]
    draft_token_ids: list[list[int]]  # [num_reqs][num_draft_tokens]


class KVConnectorOutput(msgspec.Struct, Generic[RID], array_like=True, omit_defaults=True, gc=False):
    """KV transfer progress reported by a KV connector (disaggregated prefill)."""

    finished_sending: set[RID] | None = None
    finished_recving: set[RID] | None = None
    kv_connector_stats: Opaque | None = None  # vLLM: KVConnectorStats
    kv_cache_events: Opaque | None = None
    kv_connector_worker_meta: Opaque | None = None
    invalid_block_ids: set[int] = set()  # externally computed blocks that failed to load
    expected_finished_count: int = 0

    def is_empty(self) -> bool:
        """True when there is nothing to report (vLLM's `is_empty`)."""
        return not (self.finished_sending or self.finished_recving or self.kv_connector_stats or self.invalid_block_ids)


class ECConnectorOutput(msgspec.Struct, Generic[RID], array_like=True, omit_defaults=True, gc=False):
    """Encoder-cache transfer progress (vLLM's `ECConnectorOutput`)."""

    finished_sending: set[RID] | None = None
    finished_recving: set[RID] | None = None


class ModelRunnerOutput(msgspec.Struct, Generic[RID], array_like=True, omit_defaults=True, gc=False):
    """The runner's result for one step."""

    req_ids: list[RID]  # [num_reqs], in the persistent batch's order
    req_id_to_index: dict[RID, int]  # req_id -> index in req_ids
    # [num_reqs][num_generated_tokens]; [] = nothing sampled (partial prefill chunk, or discarded)
    sampled_token_ids: list[list[int]] = []
    logprobs: LogprobsLists | None = None  # rows follow req_ids (x generated tokens)
    # req_id -> prompt logprobs: [prompt_len - 1, num_prompt_logprobs + 1]; None while the prefill is chunked
    prompt_logprobs_dict: dict[RID, LogprobsTensors | None] = {}
    prompt_token_id_logprobs_dict: dict[RID, Array] = {}  # req_id -> [num_scored_rows, num_token_ids]
    pooler_output: list[Array | None] | None = None  # [num_reqs][hidden_size]
    kv_connector_output: KVConnectorOutput[RID] | None = None
    ec_connector_output: ECConnectorOutput[RID] | None = None
    num_nans_in_logits: dict[RID, int] | None = None  # req_id -> NaNs seen in its logits
    cudagraph_stats: Opaque | None = None
    # req_id -> its MoE routing (vLLM 0.31 on; 0.29-0.30 send `routed_experts` below); captures written before it
    # was mirrored hold an Opaque summary
    aux_output_connector_output: dict[RID, AuxRequestOutput] | Opaque | None = None
    sampling_masks: Opaque | None = None  # vLLM 0.32: SamplingMaskLists
    # MoE routing of every scheduled token (vLLM 0.29-0.30 with enable_return_routed_experts; 0.31 moved it to the
    # aux output connector, which needs Model Runner V2)
    routed_experts: RoutedExpertsLists | None = None

    def routing(self, so: Any) -> dict[RID, tuple[int, np.ndarray]]:
        """req_id -> (the token index of its first row, its MoE routing rows [n, num_moe_layers, top_k]) this step,
        from whichever form this vLLM sent (`so`: the step's SchedulerOutput, which places 0.29-0.30's rows); {}
        without routing."""
        if isinstance(self.aux_output_connector_output, dict) and self.aux_output_connector_output:
            return {rid: (out.token_start, out.rows.to_numpy())
                    for rid, out in self.aux_output_connector_output.items()}
        if self.routed_experts is None:
            return {}
        first, drafts = so.num_computed_before(), so.scheduled_spec_decode_tokens
        out = {}
        for rid, rows in self.routed_experts.rows(self.req_ids, so.num_scheduled_tokens).items():
            if drafts.get(rid):  # rows past the first rejected draft were computed on tokens that never were
                rows = rows[:len(rows) - len(drafts[rid]) + max(len(self.sampled(rid)) - 1, 0)]
            out[rid] = (first.get(rid, 0), rows)
        return out

    def sampled(self, req_id: RID) -> list[int]:
        """Tokens sampled for `req_id` this step ([] if none or not in the batch)."""
        i = self.req_id_to_index.get(req_id)
        return self.sampled_token_ids[i] if i is not None and i < len(self.sampled_token_ids) else []


EMPTY_MODEL_RUNNER_OUTPUT: ModelRunnerOutput = ModelRunnerOutput(req_ids=[], req_id_to_index={})
