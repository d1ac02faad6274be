"""Another engine's objects -> our contracts, field by field, driven by the contracts' own type information.

The input is either live objects (dataclasses, msgspec Structs, NamedTuples: read with getattr) or their msgpack
image decoded to builtins (dicts for dataclasses and Structs, lists for NamedTuples, encoded `Array`s / `Opaque`s as
lists), which is how the vLLM tap hands steps to the writer process: msgspec encodes vLLM's objects on the engine
thread in microseconds, and this slower, tolerant walk runs in the writer process.

Tolerant of version drift: a field we mirror and the source lacks takes our default; a field the source has and we
do not is counted in `unknown_fields`; a private spelling (`_eos_token_id`) fills our public field; tensors and
arrays become `Array`s bit for bit; anything we cannot represent becomes an `Opaque` summary. Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgspec
from msgspec import inspect as mi

from replay.contracts.arrays import Array, Opaque

_MISSING = object()


class TolerantConverter:
    """Converts objects, or their builtins image, into contract Structs; remembers fields it had no place for."""

    def __init__(self):
        self.unknown_fields: dict[str, set[str]] = {}
        self._infos: dict[Any, mi.Type] = {}

    def convert(self, value: Any, contract: Any) -> Any:
        """`value` as an instance of `contract` (e.g. `SchedulerOutput[str]`)."""
        info = self._infos.get(contract)
        if info is None:
            info = self._infos[contract] = mi.type_info(contract)
        return self._conv(value, info)

    def _conv(self, v: Any, t: mi.Type) -> Any:
        if isinstance(t, mi.UnionType):
            if v is None:
                return None
            options = [x for x in t.types if not isinstance(x, mi.NoneType)]
            for x in options:  # the first option that accepts the value's kind
                if _accepts(x, v):
                    return self._conv(v, x)
            return self._conv(v, options[0])
        if isinstance(t, mi.StructType):
            if t.cls is Array:
                return _array(v)
            if t.cls is Opaque:
                return _opaque(v)
            return self._struct(v, t)
        if isinstance(t, (mi.ListType, mi.VarTupleType)):
            if isinstance(v, str):  # vLLM's `stop: str | list[str]`
                v = [v]
            elif hasattr(v, "tolist"):  # an ndarray where we keep a list
                v = v.tolist()
            it = t.item_type
            if isinstance(it, _PRIMITIVE):
                items = list(v or ())  # the common case (token ids, request ids) without a call per element
            elif _prim_list(it):
                items = [list(x) for x in (v or ())]  # sampled_token_ids, new_token_ids, block_ids
            else:
                items = [self._conv(x, it) for x in (v or [])]
            return items if isinstance(t, mi.ListType) else tuple(items)
        if isinstance(t, mi.TupleType):
            return tuple(self._conv(x, it) for x, it in zip(v, t.item_types))
        if isinstance(t, (mi.SetType, mi.FrozenSetType)):
            return {self._conv(x, t.item_type) for x in (v or ())}
        if isinstance(t, mi.DictType):
            if not isinstance(v, dict):  # an object we keep as its field dict (StructuredOutputsParams)
                v = _plain(v)
                if not isinstance(v, dict):
                    return {"repr": v}
            if isinstance(t.key_type, _PRIMITIVE):
                if isinstance(t.value_type, _PRIMITIVE):
                    return dict(v)  # num_scheduled_tokens, req_id_to_index: decoded msgpack has the right kinds
                if _prim_list(t.value_type):
                    return {k: list(x) for k, x in v.items()}
            return {self._conv(k, t.key_type): self._conv(x, t.value_type) for k, x in v.items()}
        if isinstance(t, mi.IntType):
            return int(v)
        if isinstance(t, mi.FloatType):
            return float(v)
        if isinstance(t, mi.BoolType):
            return bool(v)
        if isinstance(t, mi.StrType):
            return str(v)
        if isinstance(t, mi.EnumType):
            return t.cls(v.value if isinstance(v, enum.Enum) else v)
        if isinstance(t, mi.AnyType):
            return _plain(v)
        return v

    def _struct(self, v: Any, t: mi.StructType) -> Any:
        if isinstance(v, (list, tuple)):  # a NamedTuple's image: fields by position
            v = dict(zip((f.name for f in t.fields), v))
        get = v.get if isinstance(v, dict) else (lambda name, default: getattr(v, name, default))
        kwargs = {}
        names = set()
        for f in t.fields:
            # vLLM keeps some sampling fields private (`_eos_token_id`): look for both spellings
            src = get(f.name, _MISSING)
            if src is _MISSING:
                src = get("_" + f.name, _MISSING)
            names.add(f.name)
            if src is _MISSING:
                if f.required:  # a field the source does not have and we have no default for
                    kwargs[f.name] = None
                continue  # our default
            if callable(src) and not hasattr(src, "__len__") and not isinstance(src, (int, float, str)):
                continue  # a method of the same name (e.g. a property shadowing): keep our default
            kwargs[f.name] = self._conv(src, f.type)
        theirs = list(v) if isinstance(v, dict) else _field_names(v)
        extra = {n.lstrip("_") for n in theirs} - names
        if extra:
            kind = t.cls.__name__ if isinstance(v, dict) else type(v).__name__
            self.unknown_fields.setdefault(kind, set()).update(extra)
        return t.cls(**kwargs)


_PRIMITIVE = (mi.IntType, mi.StrType, mi.FloatType, mi.BoolType)


def _prim_list(t: mi.Type) -> bool:
    return isinstance(t, (mi.ListType, mi.VarTupleType)) and isinstance(t.item_type, _PRIMITIVE)


def _array(v: Any) -> Array:
    if isinstance(v, Array):
        return v
    if isinstance(v, (list, tuple)) and v and isinstance(v[0], str):  # an encoded Array: [dtype, shape, data, ...]
        return msgspec.convert(v, Array)
    return Array.from_any(v)


def _opaque(v: Any) -> Opaque:
    if isinstance(v, Opaque):
        return v
    if isinstance(v, (list, tuple)):
        try:
            return msgspec.convert(v, Opaque)
        except msgspec.ValidationError:
            pass
    return Opaque.of(v)


def _accepts(t: mi.Type, v: Any) -> bool:
    """Whether a union member fits the value's kind."""
    if isinstance(t, mi.StructType):
        if t.cls is Array:
            return hasattr(v, "shape") and hasattr(v, "dtype") or (
                isinstance(v, (list, tuple)) and bool(v) and isinstance(v[0], str))
        if t.cls is Opaque:
            return True
        return not isinstance(v, (str, int, float, bool, set))
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.TupleType)):
        return isinstance(v, (list, tuple))
    if isinstance(t, (mi.SetType, mi.FrozenSetType)):
        return isinstance(v, (set, frozenset, list, tuple))
    if isinstance(t, mi.DictType):
        return isinstance(v, dict)
    if isinstance(t, mi.StrType):
        return isinstance(v, str)
    if isinstance(t, (mi.IntType, mi.EnumType)):
        return isinstance(v, int) and not isinstance(v, bool)
    if isinstance(t, mi.FloatType):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if isinstance(t, mi.BoolType):
        return isinstance(v, bool)
    return True


def _field_names(v: Any) -> list[str]:
    if dataclasses.is_dataclass(v):
        return [f.name for f in dataclasses.fields(v)]
    if isinstance(v, msgspec.Struct):
        return list(v.__struct_fields__)
    if hasattr(v, "_fields"):  # NamedTuple
        return list(v._fields)
    return []


def _plain(v: Any) -> Any:
    """A JSON-able copy for `Any` fields (extra_args, kv_transfer_params); what is not becomes a summary string."""
    try:
        return msgspec.to_builtins(v, enc_hook=lambda x: f"<{type(x).__module__}.{type(x).__qualname__}>")
    except (TypeError, ValueError):
        return f"<{type(v).__module__}.{type(v).__qualname__}>"
