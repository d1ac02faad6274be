"""`StepImage` records (format 1.3): another engine's step stored as its tap encoded it, converted when read.

Why: converting a vLLM step into contracts (decode, convert, intern ids) would be most of what a writer process
spends per step, more than a naive tap's whole `pickle.dump`. Stored as images, a
step costs the writer a glance at a few fields (for the seek index), moving the logprob matrices into the chunk's
columns, and compression; the images keep every field the engine sent, mirrored by our contracts or not. Reading
pays the conversion instead (`ImageDecoder`: msgspec's typed decoding, the tolerant walk where the image differs),
and yields the very `Step` a capture of contracts holds.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import msgspec

from replay.capture.codec.columns import ColumnSink, ColumnSource, is_marker
from replay.capture.format import records as fmt
from replay.contracts import (
    Array,
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


SCHEDULE = msgspec.msgpack.Decoder(_ScheduleHead)  # a SchedulerOutput image's head: index fields and lengths only


def is_nil(raw: msgspec.Raw | bytes | None) -> bool:
    """Whether an image is absent (None, or msgpack nil: a Raw cannot sit in a union with None)."""
    return raw is None or (len(raw) == 1 and bytes(raw) == b"\xc0")


class OutputParts(NamedTuple):
    """A ModelRunnerOutput image with its sampled tokens and logprob matrices apart (the vLLM tap sends this when
    the matrices are plain arrays), so that the writer moves the matrices into its columns without decoding and
    re-encoding the image: the stored image is `rest` with the two fields appended."""

    rest: bytes  # the image, a map, without `sampled_token_ids` and `logprobs`
    tokens: bytes  # the msgpack image of `sampled_token_ids`
    dtypes: tuple[str, str, str]  # token ids, logprobs, ranks (our names)
    shape: tuple[int, int]  # [rows, K]
    cu_num_generated_tokens: list[int] | None
    arrays: tuple[bytes, bytes, bytes]  # token ids [rows, K], logprobs [rows, K], ranks [rows]; little-endian

    def logprobs(self) -> LogprobsLists:
        """The matrices as the contract's `LogprobsLists`."""
        (a, b, c), (rows, k) = self.dtypes, self.shape
        ids, vals, ranks = self.arrays
        return LogprobsLists(Array(a, (rows, k), ids), Array(b, (rows, k), vals), Array(c, (rows,), ranks),
                             self.cu_num_generated_tokens)

    def whole(self) -> bytes:
        """The whole image, as the tap would have sent it in one piece (fields in another order)."""
        return self.image(self.tokens, _ENCODER.encode(self.logprobs()))

    def image(self, sampled_token_ids: bytes, logprobs: bytes) -> bytes:
        """`rest` with the two fields appended, given as their encoded values (what is stored, or sent whole)."""
        return _with_fields(self.rest, _TOKENS_KEY + sampled_token_ids, _LOGPROBS_KEY + logprobs)


class ImageStepStats(msgspec.Struct):
    """A step image's figures for the seek index."""

    scheduled: int
    generated: int
    drafts: DraftCounts | None


def store_step_image(index: int, scheduler_output: bytes, model_runner_output: bytes | OutputParts | None,
                     grammar_output: bytes | None, timing: fmt.StepTiming | None, columns: ColumnSink,
                     decoder: ImageDecoder) -> tuple[fmt.StepImage, ImageStepStats]:
    """The record to store for a step given as images, its logprob matrices handed to `columns`, and its figures.
    Raises msgspec.DecodeError when an image is not msgpack at all (ValueError for inconsistent `OutputParts`)."""
    so = msgspec.Raw(scheduler_output)
    head = SCHEDULE.decode(so)
    generated, mro = 0, NIL
    if isinstance(model_runner_output, OutputParts):
        mro, generated = _store_parts(model_runner_output, columns, decoder)
    elif not is_nil(model_runner_output):
        mro = msgspec.Raw(model_runner_output)
        fields = _FIELDS.decode(model_runner_output)
        tokens = fields.get("sampled_token_ids")
        lp = fields.get("logprobs")
        taken = None
        if lp is not None and not is_nil(lp):
            try:
                taken = columns.take(_LOGPROBS.decode(lp))
            except (msgspec.ValidationError, ValueError):  # not the arrays we know: stays in the image as it is
                taken = None
        reference = None
        if taken is not None:
            fields["logprobs"] = msgspec.Raw(_ENCODER.encode(taken[0]))
            reference, generated = tokens_in_column_0(tokens, taken[1][:, 0].tolist())
            if reference is not None:
                fields["sampled_token_ids"] = reference
            mro = msgspec.Raw(_ENCODER.encode(fields))
        if reference is None:
            generated = count_tokens(tokens, model_runner_output, decoder)
    drafts = None
    if len(head.scheduled_spec_decode_tokens) > 1:  # drafts verified (rare): count them on the contracts
        whole = model_runner_output.whole() if isinstance(model_runner_output, OutputParts) else model_runner_output
        drafts = draft_counts(decoder.decode(so, SchedulerOutput[str]),
                              None if is_nil(whole) else decoder.decode(whole, ModelRunnerOutput[str]))
    go = NIL if is_nil(grammar_output) else msgspec.Raw(grammar_output)
    return (fmt.StepImage(index, so, mro, go, timing),
            ImageStepStats(head.total_num_scheduled_tokens, generated, drafts))


_TOKENS_KEY, _LOGPROBS_KEY = _ENCODER.encode("sampled_token_ids"), _ENCODER.encode("logprobs")


def _store_parts(parts: OutputParts, columns: ColumnSink, decoder: ImageDecoder) -> tuple[msgspec.Raw, int]:
    """The stored image of an output sent in parts, and its number of tokens: what `store_step_image` makes of
    the whole image, without decoding it (the two fields join the map at its end; order does not matter in a map)."""
    lists = parts.logprobs()
    taken = columns.take(lists)  # ValueError when the bytes do not fit the shape
    reference = None
    if taken is not None:
        reference, generated = tokens_in_column_0(msgspec.Raw(parts.tokens), taken[1][:, 0].tolist())
    lp = _ENCODER.encode(taken[0] if taken is not None else lists)
    image = msgspec.Raw(parts.image(bytes(reference or parts.tokens), lp))
    if reference is None:
        generated = count_tokens(msgspec.Raw(parts.tokens), image, decoder)
    return image, generated


def _with_fields(image: bytes, *pairs: bytes) -> bytes:
    """A msgpack map `image` with `pairs` (each an encoded key and value) appended. ValueError if it is no map."""
    first = image[0] if image else 0
    if 0x80 <= first <= 0x8F:
        n, body = first & 0x0F, memoryview(image)[1:]
    elif first == 0xDE:
        n, body = int.from_bytes(image[1:3], "big"), memoryview(image)[3:]
    elif first == 0xDF:
        n, body = int.from_bytes(image[1:5], "big"), memoryview(image)[5:]
    else:
        raise ValueError("an output image sent in parts is not a map")
    n += len(pairs)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdf" + n.to_bytes(4,
                                                                                                                    "big")
    return b"".join((head, body, *pairs))


# The sampled tokens, when the logprob rows repeat them in column 0 (vLLM always puts the sampled token there),
# are stored as where to find them (-1.9 B per generated token on the vLLM bench): {"column-0": rows, "counts":
# tokens per request}. Rows "tokens": one row per sampled token, in order (also with drafts); "requests": one row
# per request, whose list is that row's token or empty (a partial prefill's discarded row).
_DERIVED = "column-0"


class _Derived(msgspec.Struct):
    rows: str = msgspec.field(name=_DERIVED)
    counts: list[int] = []


_DERIVED_DECODER = msgspec.msgpack.Decoder(_Derived)


def count_tokens(tokens: msgspec.Raw | None, image: bytes, decoder: ImageDecoder) -> int:
    """How many tokens an output image's `sampled_token_ids` hold (counted on the contract for another form)."""
    try:
        return sum(map(len, _TOKENS.decode(tokens))) if tokens is not None else 0
    except msgspec.ValidationError:
        return sum(map(len, decoder.decode(image, ModelRunnerOutput[str]).sampled_token_ids))


@functools.lru_cache(maxsize=64)
def one_token_each(rows: int) -> msgspec.Raw:
    """The reference for a step where each of `rows` requests sampled one token (decode without drafts)."""
    return msgspec.Raw(_ENCODER.encode({_DERIVED: "tokens", "counts": [1] * rows}))


def tokens_in_column_0(tokens: msgspec.Raw | None, col0: list[int]) -> tuple[msgspec.Raw | None, int]:
    """How to read the image's sampled tokens back from the logprob rows' column 0 `col0` (None when they are not
    all there), and how many tokens there are. The common step, one token per request, is checked by encoding
    the list it would be and comparing bytes: no list of lists is decoded (the writer does this every step)."""
    if tokens is None:
        return None, 0
    if memoryview(tokens) == _ENCODER.encode([[t] for t in col0]):
        return one_token_each(len(col0)), len(col0)
    try:
        lists = _TOKENS.decode(tokens)
    except msgspec.ValidationError:
        return None, 0  # another form: counted on the contract
    counts = list(map(len, lists))
    generated = sum(counts)
    if generated == len(col0) and [t for ts in lists for t in ts] == col0:
        return msgspec.Raw(_ENCODER.encode({_DERIVED: "tokens", "counts": counts})), generated
    if len(lists) == len(col0) and all(c <= 1 for c in counts) and all(not t or t[0] == c0 for t,
                                                                       c0 in zip(lists, col0)):
        return msgspec.Raw(_ENCODER.encode({_DERIVED: "requests", "counts": counts})), generated
    return None, generated


def is_token_reference(tokens: msgspec.Raw | bytes | None) -> bool:
    """Whether a stored output's `sampled_token_ids` image is a reference to its logprob rows' column 0 (a map),
    not the tokens themselves."""
    return tokens is not None and len(tokens) > 0 and 0x80 <= memoryview(tokens)[0] <= 0x8F


def derived_tokens(reference: msgspec.Raw | bytes, lp: LogprobsLists | None) -> list[list[int]]:
    """The sampled tokens a reference (`is_token_reference`) stands for, read from the step's logprob rows `lp`.
    Raises ValueError when they do not fit."""
    if lp is None:
        raise ValueError("the sampled tokens refer to logprob rows the step does not have")
    return _tokens_from_column_0(_DERIVED_DECODER.decode(reference), lp)


def _tokens_from_column_0(how: _Derived, lp: LogprobsLists) -> list[list[int]]:
    col0 = lp.logprob_token_ids.to_numpy()[:, 0].tolist()
    if how.rows == "tokens" and sum(how.counts) == len(col0):
        out, at = [], 0
        for c in how.counts:
            out.append(col0[at:at + c])
            at += c
        return out
    if how.rows == "requests" and len(how.counts) == len(col0) and all(c in (0, 1) for c in how.counts):
        return [[t] if c else [] for t, c in zip(col0, how.counts)]
    raise ValueError(f"the sampled tokens' reference ({how.rows}) does not fit the logprob rows")


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
    if is_token_reference(tokens):  # a map: the reference, not a list
        fields["sampled_token_ids"] = msgspec.Raw(_ENCODER.encode(derived_tokens(tokens, lists)))
        image = msgspec.Raw(_ENCODER.encode(fields))
    return image, lists


def image_as_sent(rec: fmt.StepImage, columns: ColumnSource | None) -> fmt.StepImage:
    """A stored image step with its output as the engine sent it (sampled tokens and logprob matrices back in the
    image), free of its chunk, for a writer to store again (`recover`). Raises ValueError on inconsistency."""
    if is_nil(rec.model_runner_output):
        return rec
    image, lists = restore_output(rec.model_runner_output, columns)
    if lists is not None:
        fields = _FIELDS.decode(image)
        fields["logprobs"] = msgspec.Raw(_ENCODER.encode(lists))
        image = msgspec.Raw(_ENCODER.encode(fields))
    return msgspec.structs.replace(rec, model_runner_output=image)


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
