"""Stored steps decoded only as far as the report's run section reads them (`StepHead`): request ids stay the
capture's int handles, a step's logprobs and block ids are skipped undecoded. Records are arrays whose fields never
move (the format's evolution rule: new fields go last), so a prefix of `replay.capture.format.Step`'s fields
decodes any version; the packed forms (`PackedStep`, `AlignedStep`) are given back their fields by `unpack`."""

from __future__ import annotations

from collections.abc import Callable
from operator import add

import msgspec

from replay.capture.codec.columns import ColumnSource
from replay.capture.codec.step_image import is_nil, restore_output
from replay.capture.codec.stepcodec import batch_order, map_request_ids
from replay.capture.format import records as fmt
from replay.contracts import EngineCoreRequest, ModelRunnerOutput, NewRequestData, SchedulerOutput
from replay.contracts.image_decoder import ImageDecoder


class _CachedHead(msgspec.Struct, array_like=True):
    """The fields of a stored CachedRequestData the report reads; block ids and token lists are skipped."""

    req_ids: list[int]
    resumed_req_ids: set[int]
    new_token_ids: msgspec.Raw
    all_token_ids: msgspec.Raw
    new_block_ids: msgspec.Raw
    num_computed_tokens: list[int]
    num_output_tokens: list[int]


class _ScheduleHead(msgspec.Struct, array_like=True):
    """The leading fields of a stored SchedulerOutput, as far as `preempted_req_ids`."""

    scheduled_new_reqs: list[NewRequestData[int]]
    scheduled_cached_reqs: _CachedHead
    num_scheduled_tokens: dict[int, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: msgspec.Raw
    scheduled_encoder_inputs: msgspec.Raw
    finished_req_ids: set[int]
    free_encoder_mm_hashes: msgspec.Raw
    scheduled_encoder_input_stats: msgspec.Raw = msgspec.Raw(b"")
    preempted_req_ids: set[int] | None = None


class OutputHead(msgspec.Struct, array_like=True):
    """The leading fields of a stored ModelRunnerOutput; the rest (logprobs and all) is skipped undecoded."""

    req_ids: list[int]
    req_id_to_index: msgspec.Raw
    sampled_token_ids: list[list[int]] = []


class StepHead(msgspec.Struct, tag="step", array_like=True):
    """A stored Step as far as its timing (a prefix of `replay.capture.format.Step`'s fields)."""

    index: int
    scheduler_output: _ScheduleHead
    model_runner_output: OutputHead | None
    drawn_seeds: msgspec.Raw = msgspec.Raw(b"")
    rng_state: msgspec.Raw = msgspec.Raw(b"")
    timing: fmt.StepTiming | None = None

    def unpack(self) -> StepHead:
        """The head with every field the report reads as the engine sent it (packed forms override this)."""
        return self


class _PackedStepHead(StepHead, tag="packed_step"):
    """A `PackedStep` (format 1.3) as far as its timing: its computed-token counts are stored against its
    output-token counts (`unpack` restores them)."""

    def unpack(self) -> StepHead:
        """The head as a `StepHead`, its computed-token counts restored."""
        c = self.scheduler_output.scheduled_cached_reqs
        c.num_computed_tokens = list(map(add, c.num_computed_tokens, c.num_output_tokens))
        return self


class _AlignedStepHead(StepHead, tag="aligned_step"):
    """An `AlignedStep` (format 1.4) as far as its timing (`unpack` gives back what its batch order left out)."""

    grammar_output: msgspec.Raw = msgspec.Raw(b"")
    num_scheduled: list[int] | None = None
    elided: int = 0

    def unpack(self) -> StepHead:
        """The head as a `StepHead`: computed-token counts, scheduled-token counts and output ids restored."""
        so, mro = self.scheduler_output, self.model_runner_output
        c = so.scheduled_cached_reqs
        if self.elided & fmt.COMPUTED_MINUS_OUTPUT:
            c.num_computed_tokens = list(map(add, c.num_computed_tokens, c.num_output_tokens))
        order = batch_order(so)
        if self.num_scheduled is not None:
            so.num_scheduled_tokens = dict(zip(order, self.num_scheduled))
        if self.elided & fmt.OUTPUT_IDS_IN_BATCH_ORDER and mro is not None:
            mro.req_ids = order
        return self


class _LiveHead(msgspec.Struct, array_like=True):
    """The leading fields of a keyframe's `LiveRequest`: its arrival and what it generated before the keyframe."""

    request: EngineCoreRequest
    arrived: int
    scheduled: bool = False
    output_token_ids: list[int] = []


class KeyframeHead(msgspec.Struct, tag="keyframe", array_like=True):
    """A stored `Keyframe`'s step and live requests; the cached blocks and the batch are skipped undecoded."""

    step: int
    requests: list[_LiveHead]


# every record of a chunk, steps as heads
DECODER = msgspec.msgpack.Decoder(fmt.Header | fmt.RequestAdded | fmt.RequestAborted | fmt.Ids | fmt.LiveIds | StepHead
                                  | _PackedStepHead | _AlignedStepHead | fmt.LogprobColumns | fmt.StepImage | fmt.Crash
                                  | fmt.Footer | KeyframeHead)
_HEAD = msgspec.msgpack.Decoder(StepHead)


def image_head(rec: fmt.StepImage, decoder: ImageDecoder, columns: ColumnSource | None,
               handle: Callable[[str], int]) -> StepHead:
    """A step stored as another engine's images (format 1.3), as far as `StepHead` reads a stored step: converted
    (its sampled tokens may live in the chunk's logprob `columns`), ids given handles (`handle`), logprobs left out."""
    so = decoder.decode(rec.scheduler_output, SchedulerOutput[str])
    mro = None
    if not is_nil(rec.model_runner_output):
        image, _ = restore_output(rec.model_runner_output, columns)
        mro = msgspec.structs.replace(decoder.decode(image, ModelRunnerOutput[str]), logprobs=None)
    step = map_request_ids(fmt.Step(rec.index, so, mro, timing=rec.timing), handle)
    return _HEAD.decode(fmt.WIRE_ENCODER.encode(step))
