"""Mirrors `vllm/v1/engine/__init__.py` and `vllm/v1/request.py` (vLLM 0.32): requests in, outputs out.

vLLM declares these `array_like=True, omit_defaults=True, gc=False`; so do we.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from replay.contracts.arrays import Array, Opaque
from replay.contracts.outputs import LogprobsLists, LogprobsTensors
from replay.contracts.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished. Int rather than str for compact serialisation (as vLLM)."""

    STOP = 0  # a stop token or string was emitted
    LENGTH = 1  # max_tokens consumed or max_model_len reached
    ABORT = 2  # aborted by the client
    ERROR = 3  # retryable request-level internal error
    REPETITION = 4  # repetition detection fired

    def __str__(self) -> str:
        return self.name.lower()


class RequestStatus(enum.IntEnum):
    """Scheduler-side status of a request; everything after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for every FINISHED_* status."""
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        """The FinishReason reported for a status, or None while it is not finished."""
        return _FINISHED_REASON_MAP.get(status)


_FINISHED_REASON_MAP = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.WAITING_FOR_STREAMING_REQ: FinishReason.STOP,
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
}


class EngineCoreEventType(enum.IntEnum):
    """The type of an engine-core request event."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct):
    """A timestamped request event. Monotonic clock of the engine process: never compare across processes."""

    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType, timestamp: float | None = None) -> EngineCoreEvent:
        """An event stamped now unless a timestamp is given."""
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request as the frontend hands it to the engine core."""

    request_id: str  # internal id: vLLM appends a random suffix to the user's id
    prompt_token_ids: list[int] | None  # [num_prompt_tokens]
    mm_features: list[Opaque] | None  # vLLM: list[MultiModalFeatureSpec]
    sampling_params: SamplingParams | None
    pooling_params: Opaque | None  # vLLM: PoolingParams
    arrival_time: float  # wall clock (time.time()) at arrival
    lora_request: Opaque | None  # vLLM: LoRARequest
    cache_salt: str | None  # salts prefix-cache hashes
    data_parallel_rank: int | None
    prompt_embeds: Array | None = None  # [num_prompt_tokens, hidden_size]
    prompt_is_token_ids: list[bool] | None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    resumable: bool = False
    external_req_id: str | None = None  # the user's id; compare requests across runs by this, never request_id
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    abort_immediately: bool = False
    # ours, set by the vLLM tap: the fingerprint of `lora_request`'s adapter files when the request arrived, so a
    # replay can tell the adapter it re-attaches is the recorded one ("" when not known)
    lora_fingerprint: str = ""

    @property
    def name(self) -> str:
        """How every report names this request: the user's id (else the internal one). The children of an n > 1
        request share their parent's user id; vLLM names each `{index}_{parent's internal id}`, and each is shown
        as `{user id}#{index}` (the index of its choice in the OpenAI response)."""
        ext = self.external_req_id
        if not ext:
            return self.request_id
        head, sep, parent = self.request_id.partition("_")
        if sep and head.isdigit() and (parent == ext or parent.startswith(ext + "-")):
            return f"{ext}#{int(head)}"
        return ext

    @property
    def params(self) -> SamplingParams | Opaque:
        """The sampling params, else the pooling params."""
        if self.sampling_params is not None:
            return self.sampling_params
        if self.pooling_params is None:
            raise ValueError(f"request {self.request_id} has neither sampling nor pooling params")
        return self.pooling_params


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's increment of output after a step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs_tensors: LogprobsTensors | None = None
    pooling_output: Array | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    events: list[EngineCoreEvent] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    trace_headers: dict[str, str] | None = None
    prefill_stats: Opaque | None = None
    routed_experts: Array | None = None  # [seq_len, num_layers, topk]
    num_nans_in_logits: int = 0

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """All outputs of one engine step, as `update_from_output` returns them (per client)."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []  # [num_reqs]
    scheduler_stats: Opaque | None = None  # vLLM: SchedulerStats
    timestamp: float = 0.0  # monotonic; vLLM fills time.monotonic() when 0
    utility_output: Opaque | None = None
    finished_requests: set[str] | None = None
    wave_complete: int | None = None  # DP: the current wave finished
    start_wave: int | None = None  # DP: a request arrived for an old wave
