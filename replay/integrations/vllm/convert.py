"""vLLM objects -> the project's contracts, and back where replay needs vLLM's own types.

Two routes, one set of rules (`replay.contracts.tolerant`):
- on the engine thread, the tap only msgspec-encodes vLLM's objects (`ENCODER`: dataclasses and Structs natively,
  tensors and ndarrays as our `Array`, anything else as an `Opaque` summary); the writer process converts that image
  into contracts, field by field;
- at replay, `Converter` walks live vLLM objects (the ModelRunnerOutput of vLLM's runner) directly.
Nothing is pickled.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec
import numpy as np

from replay.capture.codec.step_image import OutputParts
from replay.contracts import Array, EngineCoreRequest, Opaque, SamplingParams
from replay.contracts.arrays import dtype_name
from replay.contracts.lora import lora_fields
from replay.contracts.tolerant import TolerantConverter


class Converter(TolerantConverter):
    """Converts vLLM objects (or their msgpack image) into contract Structs; `unknown_fields` lists what vLLM
    sent that we have no place for."""


def _enc_hook(x: Any) -> Any:
    """What msgspec cannot encode natively: tensors and arrays bit for bit, numpy scalars, else a summary."""
    if type(x) is np.ndarray:  # the logprob matrices of every step: straight to the packer
        return Array.from_numpy(x)
    if hasattr(x, "__array__") and hasattr(x, "dtype") and hasattr(x, "shape"):
        return Array.from_any(x)
    if hasattr(x, "item") and hasattr(x, "dtype"):  # a numpy scalar
        return x.item()
    return Opaque.of(x)


ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_REQUEST_FIELDS = EngineCoreRequest.__struct_fields__

# The fields an output image leaves to `OutputParts`, and the LogprobsLists form it takes them from
_APART = ("sampled_token_ids", "logprobs")
_LOGPROB_FIELDS = ("logprob_token_ids", "logprobs", "sampled_token_ranks", "cu_num_generated_tokens")
_field_names: dict[type, tuple[str, ...] | None] = {}


def output_image(mro: Any) -> bytes | OutputParts:
    """What the tap sends of a ModelRunnerOutput: `OutputParts` when it has logprob matrices in the form the
    writer's columns take, else its whole image. Bytes are copied now: update_from_output may reuse buffers."""
    encode = ENCODER.encode
    lp = getattr(mro, "logprobs", None)
    if lp is None or getattr(lp, "_fields", None) != _LOGPROB_FIELDS:
        return encode(mro)
    names = _field_names.get(type(mro), ())
    if names == ():
        names = _field_names[type(mro)] = _image_fields(type(mro))
    ids, vals, ranks = lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks
    if names is None or not (type(ids) is type(vals) is type(ranks) is np.ndarray) or ids.ndim != 2 \
            or vals.shape != ids.shape or ranks.shape != ids.shape[:1]:
        return encode(mro)
    try:
        dtypes = (_name(ids.dtype), _name(vals.dtype), _name(ranks.dtype))
    except ValueError:
        return encode(mro)
    rest = encode({f: getattr(mro, f) for f in names})
    cu = lp.cu_num_generated_tokens
    return OutputParts(rest, encode(mro.sampled_token_ids), dtypes, ids.shape,
                       None if cu is None else list(map(int, cu)),
                       (_le_bytes(ids), _le_bytes(vals), _le_bytes(ranks)))


def _image_fields(cls: type) -> tuple[str, ...] | None:
    """The fields msgspec encodes of a dataclass output, but those sent apart; None when it is no dataclass."""
    import dataclasses

    if not dataclasses.is_dataclass(cls):
        return None
    names = tuple(f.name for f in dataclasses.fields(cls))
    return tuple(n for n in names if n not in _APART) if set(_APART) <= set(names) else None


_names: dict[np.dtype, str] = {}


def _name(dt: np.dtype) -> str:
    name = _names.get(dt)
    if name is None:
        name = _names[dt] = dtype_name(dt)
    return name


def _le_bytes(a: np.ndarray) -> bytes:
    """Little-endian, C order, whatever the strides."""
    return a.tobytes() if a.dtype.byteorder in _NATIVE_LE else a.astype(a.dtype.newbyteorder("<")).tobytes()


_NATIVE_LE = "<|=" if sys.byteorder == "little" else "<|"


def request_image(request: Any, external_req_id: str | None = None) -> dict:
    """A vLLM `Request` (a plain class msgspec cannot encode) as the fields our EngineCoreRequest mirrors."""
    out = {}
    for name in _REQUEST_FIELDS:
        value = getattr(request, name, None)
        if value is None:
            value = getattr(request, "_" + name, None)
        if value is not None and not callable(value):
            out[name] = value
    if external_req_id is not None:
        out["external_req_id"] = external_req_id
    return out


def to_vllm_sampling_params(ours: SamplingParams) -> Any:
    """Our SamplingParams as vLLM's, private fields (`_eos_token_id`, ...) included, so sampling is the same."""
    from vllm import SamplingParams as VSP

    fields = {f: getattr(ours, f) for f in ours.__struct_fields__ if f in VSP.__struct_fields__}
    fields["output_kind"] = type(VSP().output_kind)(int(ours.output_kind))
    fields.pop("repetition_detection", None)
    sp = VSP(**{k: v for k, v in fields.items() if v is not None or k in ("seed", "max_tokens")})
    for private in ("eos_token_id", "all_stop_token_ids", "bad_words_token_ids"):
        value = getattr(ours, private)
        if value is not None:
            setattr(sp, "_" + private, set(value) if private == "all_stop_token_ids" else value)
    return sp


def to_vllm_lora_request(opaque: Opaque | None) -> Any:
    """vLLM's LoRARequest for a recorded one (None for none); ValueError when the capture did not keep its fields."""
    if opaque is None:
        return None
    fields = lora_fields(opaque)
    if fields is None:
        raise ValueError(f"the capture keeps only a summary of this LoRA request ({opaque.summary[:80]})")
    from vllm.lora.request import LoRARequest

    return LoRARequest(*fields)
