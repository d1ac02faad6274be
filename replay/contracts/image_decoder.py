"""Another engine's msgpack image -> our contract, at msgspec's C speed when the image has our field types.

The tolerant walk (`replay.contracts.tolerant`) converts a decoded image field by field in Python, which is slow
for a large vLLM step. Yet almost every
image already has the kinds our contracts declare; only the outer shape differs: vLLM's dataclasses encode as
maps, our contracts are `array_like` (positional). So for each contract we derive a *map twin*, a Struct with the
same field names, types and defaults that decodes from a map (unknown fields ignored, as the tolerant walk
ignores them), decode the image into it with a typed msgspec decoder, and convert the twin into the contract
with `msgspec.convert(..., from_attributes=True)`: both in C, about twice as fast (readers pay it: since format 1.3
the writer stores vLLM's images as they are).

Anything the typed decoder refuses (a field of another kind, an enum value we lack: version drift) falls back to
the tolerant walk for that one object, so the result is always what the tolerant walk would give.

Types vLLM sends positionally keep their own (array_like) contract inside a twin: NamedTuples (`LogprobsLists`,
`LogprobsTensors`, `RoutedExpertsLists`) and what our encoder writes itself (`Array`, `Opaque`).
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec
from msgspec import inspect as mi

from replay.contracts.arrays import Array, Opaque
from replay.contracts.outputs import LogprobsLists, LogprobsTensors, RoutedExpertsLists
from replay.contracts.sampling_params import SamplingParams
from replay.contracts.tolerant import TolerantConverter

POSITIONAL = (Array, Opaque, LogprobsLists, LogprobsTensors, RoutedExpertsLists)
# Map contracts whose source keeps some fields under a private spelling (vLLM's `_all_stop_token_ids`): a twin
# decodes them as a plain map, and its `__post_init__` reads `_x` as `x` (where `x` is absent) and converts.
PRIVATELY_NAMED = (SamplingParams,)


class ImageDecoder:
    """Decodes images into contracts: the typed fast path, else the tolerant walk (`fallbacks` counts those)."""

    def __init__(self, tolerant: TolerantConverter | None = None):
        self.tolerant = tolerant or TolerantConverter()
        self.fallbacks = 0
        self._decoders: dict[Any, msgspec.msgpack.Decoder | None] = {}

    def prepare(self, *contracts: Any) -> None:
        """Build the twins and decoders of `contracts` now (the first `decode` would otherwise)."""
        for contract in contracts:
            self._decoder(contract)
            self.tolerant.prepare(contract)

    def decode(self, image: bytes | msgspec.Raw, contract: Any) -> Any:
        """`image` (a msgpack-encoded object of another engine) as an instance of `contract`."""
        dec = self._decoder(contract)
        if dec is not None:
            try:
                return msgspec.convert(dec.decode(image), contract, from_attributes=True)
            except msgspec.ValidationError:
                pass
        self.fallbacks += 1
        return self.tolerant.convert(msgspec.msgpack.decode(image), contract)

    def _decoder(self, contract: Any) -> msgspec.msgpack.Decoder | None:
        if contract not in self._decoders:
            try:
                self._decoders[contract] = msgspec.msgpack.Decoder(_twin(mi.type_info(contract), {}))
            except (TypeError, ValueError):  # a type no twin can express: the tolerant walk only
                self._decoders[contract] = None
        return self._decoders[contract]


def _twin(t: mi.Type, twins: dict[type, Any]) -> Any:
    """The annotation that decodes `t`'s image: structs as map twins, containers of twins, scalars as they are."""
    if isinstance(t, mi.StructType):
        if t.cls in POSITIONAL:
            return t.cls
        if t.cls in PRIVATELY_NAMED:
            return dict[str, Any]
        if t.cls not in twins:
            renamed = {f.name: _privately_named(f.type) for f in t.fields if _privately_named(f.type)}
            twins[t.cls] = msgspec.defstruct(
                t.cls.__name__ + "Image",
                [(f.name, _twin(f.type, twins), _default(f)) for f in t.fields],
                kw_only=True, gc=False, namespace={"__post_init__": _post_init(renamed)} if renamed else None)
        return twins[t.cls]
    if isinstance(t, mi.UnionType):
        return Union[tuple(_twin(x, twins) for x in t.types)]  # noqa: UP007 - built at run time
    if isinstance(t, mi.ListType):
        return list[_twin(t.item_type, twins)]
    if isinstance(t, mi.VarTupleType):
        return tuple[_twin(t.item_type, twins), ...]
    if isinstance(t, mi.TupleType):
        return tuple[tuple(_twin(x, twins) for x in t.item_types)]
    if isinstance(t, mi.SetType):
        return set[_twin(t.item_type, twins)]
    if isinstance(t, mi.FrozenSetType):
        return frozenset[_twin(t.item_type, twins)]
    if isinstance(t, mi.DictType):
        return dict[_twin(t.key_type, twins), _twin(t.value_type, twins)]
    if isinstance(t, mi.LiteralType):
        return Literal[tuple(t.values)]
    if isinstance(t, mi.EnumType):
        return t.cls
    scalars = {mi.IntType: int, mi.FloatType: float, mi.BoolType: bool, mi.StrType: str, mi.BytesType: bytes,
               mi.NoneType: type(None)}
    for kind, py in scalars.items():
        if isinstance(t, kind):
            return py
    if isinstance(t, mi.AnyType):
        return Any
    raise TypeError(f"no image twin for {t!r}")


def _privately_named(t: mi.Type) -> Any:
    """The privately named contract a field holds (directly or as `X | None`), else None."""
    options = t.types if isinstance(t, mi.UnionType) else (t,)
    for x in options:
        if isinstance(x, mi.StructType) and x.cls in PRIVATELY_NAMED:
            return x.cls
    return None


def _post_init(renamed: dict[str, Any]):
    """A twin's `__post_init__`: its privately named fields, decoded as maps, become their contracts, each `_x`
    read as `x` where `x` is absent (as the tolerant walk reads them); a map that does not fit raises
    ValidationError, and the whole image takes the tolerant walk."""
    def __post_init__(self):
        for name, contract in renamed.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                fields = {(k[1:] if k[:1] == "_" and k[1:] not in value else k): v for k, v in value.items()}
                setattr(self, name, msgspec.convert(fields, contract))
    return __post_init__


def _default(f: mi.Field) -> Any:
    if f.default is not mi.NODEFAULT:
        return f.default
    if f.default_factory is not mi.NODEFAULT:
        return msgspec.field(default_factory=f.default_factory)
    return None  # a required field the image lacks is None, as the tolerant walk makes it (or refused, if not optional)
