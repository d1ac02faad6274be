"""What the writer's keyframe shadow reads of another engine's step: the fields `ShadowTable.step` folds, and no more.

Why: the shadow folds every step the writer writes, so the writer process decodes each vLLM step a second time. The
whole SchedulerOutput (its map twin, then the convert into our contract: `ImageDecoder`) took 19 µs a step of 64
decoding requests on the vLLM bench; `SchedulerView` reads the same map image for the fields the fold uses, with
the contract's types, in about a third of that. A field it reads therefore holds what the contract's would. Fields
the contract requires are required here too, so an image it cannot read that way (another version's kinds, an
array-like image) raises, and the whole decode takes over (`scheduled`); so does a step that schedules a request
the shadow has no arrival for, since rebuilding one needs its sampling parameters (`ShadowTable.knows`).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from replay.capture.codec.columns import ColumnSource, is_marker
from replay.capture.codec.step_image import (
    OutputParts,
    derived_tokens,
    is_nil,
    is_token_reference,
    step_from_image,
)
from replay.capture.format import records as fmt
from replay.contracts import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from replay.contracts.image_decoder import ImageDecoder


class NewRequestView(msgspec.Struct, gc=False):
    """`NewRequestData`'s fields the shadow reads (vLLM's image is a map)."""

    req_id: str
    prompt_token_ids: list[int] | None  # [num_prompt_tokens]
    block_ids: tuple[list[int], ...]  # [num_kv_cache_groups][num_blocks]
    num_computed_tokens: int  # > 0 on a prefix-cache hit


class CachedRequestsView(msgspec.Struct, gc=False):
    """`CachedRequestData`'s fields the shadow reads; lists parallel to `req_ids`."""

    req_ids: list[str]  # [num_reqs]
    resumed_req_ids: set[str]
    new_block_ids: list[tuple[list[int], ...] | None]  # [num_reqs][num_kv_cache_groups][num_new_blocks]
    num_computed_tokens: list[int]  # [num_reqs]
    num_output_tokens: list[int]  # [num_reqs]


class SchedulerView(msgspec.Struct, gc=False):
    """`SchedulerOutput`'s fields the shadow reads."""

    scheduled_new_reqs: list[NewRequestView]
    scheduled_cached_reqs: CachedRequestsView
    num_scheduled_tokens: dict[str, int]  # req_id -> num_scheduled_tokens (drafts included)
    scheduled_spec_decode_tokens: dict[str, list[int]]  # req_id -> draft token ids
    finished_req_ids: set[str]
    preempted_req_ids: set[str] | None = None  # Model Runner V2 only


class _OutputHead(msgspec.Struct, gc=False):
    """A ModelRunnerOutput image's fields the shadow reads; the tokens and logprobs stay bytes until needed."""

    req_ids: list[str]  # [num_reqs]
    sampled_token_ids: msgspec.Raw = msgspec.Raw(b"\xc0")
    logprobs: msgspec.Raw = msgspec.Raw(b"\xc0")
    num_nans_in_logits: dict[str, int] | None = None


_VIEW = msgspec.msgpack.Decoder(SchedulerView)
_HEAD = msgspec.msgpack.Decoder(_OutputHead)
_TOKENS = msgspec.msgpack.Decoder(list[list[int]])
_LOGPROBS = msgspec.msgpack.Decoder(LogprobsLists)


def scheduled(image: bytes | msgspec.Raw, decoder: ImageDecoder) -> SchedulerView | SchedulerOutput:
    """A SchedulerOutput image as the shadow reads it: the view where the image has the contract's kinds, else the
    whole contract."""
    try:
        return _VIEW.decode(image)
    except msgspec.ValidationError:
        return decoder.decode(image, SchedulerOutput[str])


class FoldStep(NamedTuple):
    """A step as the shadow folds it (`fmt.Step`'s attributes that `ShadowTable.step` reads)."""

    index: int
    scheduler_output: SchedulerView | SchedulerOutput
    model_runner_output: ModelRunnerOutput | None
    drawn_seeds: dict[str, int] | None = None


def _output(head: _OutputHead, sampled: list[list[int]], lists: LogprobsLists | None) -> ModelRunnerOutput:
    return ModelRunnerOutput(head.req_ids, {}, sampled, lists, num_nans_in_logits=head.num_nans_in_logits)


def step_outline(rec: fmt.StepImage, decoder: ImageDecoder, columns: ColumnSource | None,
                 logprobs: bool = False) -> FoldStep:
    """What a runner's state follows of a stored image step: its SchedulerOutput as the shadow reads it, its
    output's `req_ids`, `sampled_token_ids` and NaN counts (and its logprobs when `logprobs`). Raises ValueError (or
    msgspec errors) on inconsistent contents."""
    so = scheduled(rec.scheduler_output, decoder)
    if is_nil(rec.model_runner_output):
        return FoldStep(rec.index, so, None)
    head = _HEAD.decode(rec.model_runner_output)
    tokens, lp = head.sampled_token_ids, head.logprobs
    lists = None
    if not is_nil(lp) and (logprobs or is_token_reference(tokens)):
        lists = _LOGPROBS.decode(lp)
        if is_marker(lists.logprob_token_ids):
            if columns is None:
                raise ValueError("the step's logprobs are in logprob columns its chunk does not have")
            lists = columns.fill(lists)
    if is_nil(tokens):
        sampled: list[list[int]] = []
    elif is_token_reference(tokens):
        sampled = derived_tokens(tokens, lists)
    else:
        try:
            sampled = _TOKENS.decode(tokens)
        except msgspec.ValidationError:  # another form (a tensor): the contract's conversion
            step = step_from_image(rec, decoder, columns)
            return FoldStep(rec.index, step.scheduler_output, step.model_runner_output)
    return FoldStep(rec.index, so, _output(head, sampled, lists if logprobs else None))


class ImageOutline(NamedTuple):
    """A step as another engine's tap sent it, kept for the keyframe shadow until its chunk is sealed (`outline`)."""

    index: int
    scheduler_output: bytes
    model_runner_output: bytes | OutputParts | None
    part: int = -1  # where its stored record is in its chunk's parts (the writer sets it)

    def outline(self, decoder: ImageDecoder, logprobs: bool = False) -> FoldStep | None:
        """`step_outline`'s step, from the images as sent (no stored record re-read, no logprob column unpacked);
        None for an output whose tokens are not a plain list of lists (then the stored record is read)."""
        so = scheduled(self.scheduler_output, decoder)
        out = self.model_runner_output
        if out is None or is_nil(out):
            return FoldStep(self.index, so, None)
        parts = out if isinstance(out, OutputParts) else None
        head = _HEAD.decode(parts.rest if parts is not None else out)
        tokens = parts.tokens if parts is not None else head.sampled_token_ids
        try:
            sampled = [] if is_nil(tokens) else _TOKENS.decode(tokens)
        except msgspec.ValidationError:
            return None
        lists = None
        if logprobs:
            lists = parts.logprobs() if parts is not None else None if is_nil(head.logprobs) else _LOGPROBS.decode(
                head.logprobs)
        return FoldStep(self.index, so, _output(head, sampled, lists))
