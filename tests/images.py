"""Contract objects as another engine's tap sends them: the images the vLLM plugin's engine thread encodes."""

from __future__ import annotations

import msgspec

from replay.contracts import Array, LogprobsLists, LogprobsTensors, Opaque


def as_map(x):
    """A contract object as a dataclass engine's image looks: Structs as maps, NamedTuples (`LogprobsLists`,
    `LogprobsTensors` in vLLM) as arrays, `Array`s and `Opaque`s as our encoder writes them."""
    if isinstance(x, (Array, Opaque)):
        return x
    if isinstance(x, (LogprobsLists, LogprobsTensors)):
        return [as_map(getattr(x, f)) for f in x.__struct_fields__]
    if isinstance(x, msgspec.Struct):
        return {f: as_map(getattr(x, f)) for f in x.__struct_fields__}
    if isinstance(x, (list, tuple, set)):
        return [as_map(v) for v in x]
    if isinstance(x, dict):
        return {k: as_map(v) for k, v in x.items()}
    return x


def as_parts(mro):
    """A contract ModelRunnerOutput as the vLLM tap sends one with plain logprob matrices: `OutputParts` (its
    image without the sampled tokens and the matrices, which go apart); its whole image when it has none."""
    from replay.capture.codec.step_image import OutputParts

    enc = msgspec.msgpack.Encoder()
    lp = mro.logprobs
    if lp is None:
        return enc.encode(as_map(mro))
    rest = {f: as_map(getattr(mro, f)) for f in mro.__struct_fields__ if f not in ("sampled_token_ids", "logprobs")}
    arrays = lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks
    return OutputParts(enc.encode(rest), enc.encode(mro.sampled_token_ids), tuple(a.dtype for a in arrays),
                       tuple(lp.logprob_token_ids.shape), lp.cu_num_generated_tokens,
                       tuple(a.to_numpy().tobytes() for a in arrays))
