"""vLLM v1 data contracts as msgspec Structs: the spine of the project. Nothing else defines these.

Field names, order and meaning follow vLLM 0.32 (`vllm/v1/core/sched/output.py`, `vllm/v1/outputs.py`); a comment marks
each place where we differ. Step contracts are generic in the request-id type (see `reqid`): `SchedulerOutput` in memory
holds vLLM's string ids, the capture stores `SchedulerOutput[int]` handles.
"""

from replay.contracts.arrays import DTYPES, Array, Opaque
from replay.contracts.engine_core import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestStatus,
)
from replay.contracts.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AuxRequestOutput,
    DraftTokenIds,
    ECConnectorOutput,
    KVConnectorOutput,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    RoutedExpertsLists,
    SamplerOutput,
)
from replay.contracts.reqid import RID
from replay.contracts.sampling_params import (
    SAMPLING_EPS,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
)
from replay.contracts.sched_output import (
    CachedRequestData,
    GrammarOutput,
    NewRequestData,
    SchedulerOutput,
)
from replay.contracts.spec_decode import DraftCounts, accepted_drafts, draft_counts

__all__ = [
    "DTYPES", "Array", "Opaque", "RID",
    "SAMPLING_EPS", "RequestOutputKind", "SamplingParams", "SamplingType",
    "NewRequestData", "CachedRequestData", "SchedulerOutput", "GrammarOutput",
    "LogprobsLists", "RoutedExpertsLists", "AuxRequestOutput", "LogprobsTensors", "SamplerOutput", "DraftTokenIds",
    "KVConnectorOutput", "ECConnectorOutput",
    "ModelRunnerOutput", "EMPTY_MODEL_RUNNER_OUTPUT",
    "EngineCoreRequest", "EngineCoreOutput", "EngineCoreOutputs", "EngineCoreEvent", "EngineCoreEventType",
    "FinishReason", "RequestStatus",
    "DraftCounts", "accepted_drafts", "draft_counts",
]
