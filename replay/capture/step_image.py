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
from replay.capture.columns import ColumnSink, ColumnSource, is_marker, plain
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
        try:
            tokens = _TOKENS.decode(fields["sampled_token_ids"]) if "sampled_token_ids" in fields else None
            generated = sum(map(len, tokens)) if tokens is not None else 0
        except msgspec.ValidationError:  # another layout of the tokens: count them on the contract
            tokens = None
            generated = sum(map(len, decoder.decode(model_runner_output, ModelRunnerOutput[str]).sampled_token_ids))
        mro = msgspec.Raw(model_runner_output)
        lp = fields.get("logprobs")
        if lp is not None and not is_nil(lp):
            try:
                lists = _LOGPROBS.decode(lp)
                marker = columns.add(lists)
            except (msgspec.ValidationError, ValueError):  # not the arrays we know: stays in the image as it is
                marker = None
            if marker is not None:
                fields["logprobs"] = msgspec.Raw(_ENCODER.encode(marker))
                derived = _tokens_in_column_0(tokens, lists)
                if derived is not None:
                    fields["sampled_token_ids"] = msgspec.Raw(_ENCODER.encode(derived))
                mro = msgspec.Raw(_ENCODER.encode(fields))
    drafts = None
    if len(head.scheduled_spec_decode_tokens) > 1:  # drafts verified (rare): count them on the contracts
        drafts = draft_counts(decoder.decode(so, SchedulerOutput[str]),
                              None if is_nil(model_runner_output) else decoder.decode(model_runner_output,
                                                                                      ModelRunnerOutput[str]))
    go = NIL if is_nil(grammar_output) else msgspec.Raw(grammar_output)
    return (fmt.StepImage(index, so, mro, go, timing),
            ImageStepStats(head.total_num_scheduled_tokens, generated, drafts))


# The sampled tokens, when the logprob rows repeat them in column 0 (vLLM always puts the sampled token there),
# are stored as where to find them (-1.9 B per generated token on the vLLM bench): {"column-0": layout, "counts":
# tokens per request}. Layout "tokens": one row per sampled token, in order (also with drafts); "requests": one row
# per request, whose list is that row's token or empty (a partial prefill's discarded row).
_DERIVED = "column-0"


class _Derived(msgspec.Struct):
    layout: str = msgspec.field(name=_DERIVED)
    counts: list[int] = []


_DERIVED_DECODER = msgspec.msgpack.Decoder(_Derived)


def _tokens_in_column_0(tokens: list[list[int]] | None, lp: LogprobsLists) -> dict | None:
    """How to read `tokens` back from the logprob rows' column 0, or None when they are not all there."""
    ids = lp.logprob_token_ids
    if tokens is None or len(ids.shape) != 2 or not ids.shape[1] or ids.filters:
        return None
    col0 = plain(ids)[:, 0].tolist()
    counts = list(map(len, tokens))
    if sum(counts) == len(col0) and [t for ts in tokens for t in ts] == col0:
        return {_DERIVED: "tokens", "counts": counts}
    if len(tokens) == len(col0) and all(c <= 1 for c in counts) and all(not t or t[0] == c0 for t, c0 in zip(tokens, col0)):
        return {_DERIVED: "requests", "counts": counts}
    return None


def _tokens_from_column_0(how: _Derived, lp: LogprobsLists) -> list[list[int]]:
    col0 = lp.logprob_token_ids.to_numpy()[:, 0].tolist()
    if how.layout == "tokens" and sum(how.counts) == len(col0):
        out, at = [], 0
        for c in how.counts:
            out.append(col0[at:at + c])
            at += c
        return out
    if how.layout == "requests" and len(how.counts) == len(col0) and all(c in (0, 1) for c in how.counts):
        return [[t] if c else [] for t, c in zip(col0, how.counts)]
    raise ValueError(f"the sampled tokens' reference ({how.layout}) does not fit the logprob rows")


def restore_output(image: msgspec.Raw, columns: ColumnSource | None) -> tuple[msgspec.Raw, LogprobsLists | None]:
    """A stored ModelRunnerOutput image as the engine sent it, sampled tokens back from the logprob columns, and its
    logprobs back from the chunk's columns (None when it had none there). Raises ValueError on inconsistency."""
    fields = _FIELDS.decode(image)
    lp = fields.get("logprobs")
    if lp is None or is_nil(lp):
        return image, None
    lists = _LOGPROBS.decode(lp)
    if not is_marker(lists.logprob_token_ids):
        return image, None
    if columns is None:
        raise ValueError("the step's logprobs are in logprob columns its chunk does not have")
    lists = columns.fill(lists)
    tokens = fields.get("sampled_token_ids")
    if tokens is not None and 0x80 <= memoryview(tokens)[0] <= 0x8F:  # a map: the reference, not a list
        fields["sampled_token_ids"] = msgspec.Raw(_ENCODER.encode(_tokens_from_column_0(_DERIVED_DECODER.decode(tokens),
                                                                                      lists)))
        image = msgspec.Raw(_ENCODER.encode(fields))
    return image, lists


def step_from_image(rec: fmt.StepImage, decoder: ImageDecoder, columns: ColumnSource | None) -> fmt.Step:
    """The `Step` a stored image step stands for (string ids, logprobs back from the chunk's columns). Raises
    ValueError (or msgspec errors) on inconsistent contents."""
    so = decoder.decode(rec.scheduler_output, SchedulerOutput[str])
    mro = None
    if not is_nil(rec.model_runner_output):
        image, lists = restore_output(rec.model_runner_output, columns)
        mro = decoder.decode(image, ModelRunnerOutput[str])
        if lists is not None:
            mro = msgspec.structs.replace(mro, logprobs=lists)
    go = None if is_nil(rec.grammar_output) else decoder.decode(rec.grammar_output, GrammarOutput[str])
    return fmt.Step(rec.index, so, mro, grammar_output=go, timing=rec.timing)
