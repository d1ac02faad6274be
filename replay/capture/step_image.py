"""`StepImage` records (format 1.3): another engine's step stored as its tap encoded it, converted when read.

Why: converting a vLLM step into contracts (decode, convert, intern ids) is most of what a writer process spends
per step (~100 µs for 64 requests), more than the naive tap's whole `pickle.dump` (~55 µs). Stored as images, a
step costs the writer a glance at a few fields (for the seek index), moving the logprob matrices into the chunk's
columns, and compression; the images keep every field the engine sent, mirrored by our contracts or not. Reading
pays the conversion instead (`ImageDecoder`: msgspec's typed decoding, the tolerant walk where the image differs),
and yields the very `Step` the writer process used to store.
"""

from __future__ import annotations

import msgspec

from replay.capture import format as fmt
from replay.capture.columns import ColumnSink, ColumnSource, is_marker
from replay.contracts import (
    DraftCounts,
    GrammarOutput,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
    draft_counts,
)
from replay.contracts.image_decoder import ImageDecoder

NIL = msgspec.Raw(b"\xc0")
_ENCODER = msgspec.msgpack.Encoder()
_FIELDS = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])  # a map image, one level deep: the rest stays bytes
_TOKENS = msgspec.msgpack.Decoder(list[list[int]])
_LOGPROBS = msgspec.msgpack.Decoder(LogprobsLists)


class _ScheduleHead(msgspec.Struct):
    """What the seek index needs of a SchedulerOutput image (the rest is skipped undecoded)."""

    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: msgspec.Raw = msgspec.Raw(b"\x80")  # {} unless drafts are verified


_SCHEDULE = msgspec.msgpack.Decoder(_ScheduleHead)


def is_nil(raw: msgspec.Raw | bytes | None) -> bool:
    """Whether an image is absent (None, or msgpack nil: a Raw cannot sit in a union with None)."""
    return raw is None or (len(raw) == 1 and bytes(raw) == b"\xc0")


class ImageStepStats(msgspec.Struct):
    """A step image's figures for the seek index."""

    scheduled: int
    generated: int
    drafts: DraftCounts | None


def store_step_image(index: int, scheduler_output: bytes, model_runner_output: bytes | None,
                     grammar_output: bytes | None, timing: fmt.StepTiming | None, columns: ColumnSink,
                     decoder: ImageDecoder) -> tuple[fmt.StepImage, ImageStepStats]:
    """The record to store for a step given as images, its logprob matrices handed to `columns`, and its figures.
    Raises msgspec.DecodeError when an image is not msgpack at all."""
    so = msgspec.Raw(scheduler_output)
    head = _SCHEDULE.decode(so)
    generated, mro = 0, NIL
    if not is_nil(model_runner_output):
        fields = _FIELDS.decode(model_runner_output)
        tokens = fields.get("sampled_token_ids")
        try:
            generated = sum(map(len, _TOKENS.decode(tokens))) if tokens is not None else 0
        except msgspec.ValidationError:  # another layout of the tokens: count them on the contract
            generated = sum(map(len, decoder.decode(model_runner_output, ModelRunnerOutput[str]).sampled_token_ids))
        mro = msgspec.Raw(model_runner_output)
        lp = fields.get("logprobs")
        if lp is not None and not is_nil(lp):
            try:
                marker = columns.add(_LOGPROBS.decode(lp))
            except msgspec.ValidationError:  # not the NamedTuple of arrays we know: stays in the image as it is
                marker = None
            if marker is not None:
                fields["logprobs"] = msgspec.Raw(_ENCODER.encode(marker))
                mro = msgspec.Raw(_ENCODER.encode(fields))
    drafts = None
    if len(head.scheduled_spec_decode_tokens) > 1:  # drafts verified (rare): count them on the contracts
        drafts = draft_counts(decoder.decode(so, SchedulerOutput[str]),
                              None if is_nil(model_runner_output) else decoder.decode(model_runner_output,
                                                                                      ModelRunnerOutput[str]))
    go = NIL if is_nil(grammar_output) else msgspec.Raw(grammar_output)
    return (fmt.StepImage(index, so, mro, go, timing),
            ImageStepStats(head.total_num_scheduled_tokens, generated, drafts))


def step_from_image(rec: fmt.StepImage, decoder: ImageDecoder, columns: ColumnSource | None) -> fmt.Step:
    """The `Step` a stored image step stands for (string ids, logprobs back from the chunk's columns). Raises
    ValueError (or msgspec errors) on inconsistent contents."""
    so = decoder.decode(rec.scheduler_output, SchedulerOutput[str])
    mro = None
    if not is_nil(rec.model_runner_output):
        mro = decoder.decode(rec.model_runner_output, ModelRunnerOutput[str])
        lp = mro.logprobs
        if lp is not None and is_marker(lp.logprob_token_ids):
            if columns is None:
                raise ValueError("the step's logprobs are in logprob columns its chunk does not have")
            mro = msgspec.structs.replace(mro, logprobs=columns.fill(lp))
    go = None if is_nil(rec.grammar_output) else decoder.decode(rec.grammar_output, GrammarOutput[str])
    return fmt.Step(rec.index, so, mro, grammar_output=go, timing=rec.timing)
