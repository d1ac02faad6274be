"""vLLM objects -> the project's contracts, field by field, driven by the contracts' own type information.

Written against vLLM 0.32 but tolerant of drift: a field we mirror and vLLM lacks takes our default; a field vLLM
has and we do not is counted in `unknown_fields` (the capture header lists them, so a reader knows what a newer
vLLM sent that we did not keep); tensors and arrays become `Array`s bit for bit; anything we cannot represent
becomes an `Opaque` summary. Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgspec
from msgspec import inspect as mi

from replay.contracts import Array, Opaque

_MISSING = object()


class Converter:
    """Converts vLLM objects into contract Structs; remembers vLLM field names it had no place for."""

    def __init__(self):
        self.unknown_fields: dict[str, set[str]] = {}
        self._infos: dict[Any, mi.Type] = {}

    def convert(self, value: Any, contract: Any) -> Any:
        """`value` (a vLLM object) as an instance of `contract` (e.g. `SchedulerOutput[str]`)."""
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
                return Array.from_any(v)
            if t.cls is Opaque:
                return v if isinstance(v, Opaque) else Opaque.of(v)
            return self._struct(v, t)
        if isinstance(t, (mi.ListType, mi.VarTupleType)):
            if isinstance(v, str):  # vLLM's `stop: str | list[str]`
                v = [v]
            items = [self._conv(x, t.item_type) for x in (v or [])]
            return items if isinstance(t, mi.ListType) else tuple(items)
        if isinstance(t, mi.TupleType):
            return tuple(self._conv(x, it) for x, it in zip(v, t.item_types))
        if isinstance(t, (mi.SetType, mi.FrozenSetType)):
            return {self._conv(x, t.item_type) for x in (v or ())}
        if isinstance(t, mi.DictType):
            if not isinstance(v, dict):  # a vLLM object we keep as its field dict (StructuredOutputsParams)
                v = _plain(v)
                if not isinstance(v, dict):
                    return {"repr": v}
            return {self._conv(k, t.key_type): self._conv(x, t.value_type) for k, x in (v or {}).items()}
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
        kwargs = {}
        names = set()
        for f in t.fields:
            # vLLM keeps some sampling fields private (`_eos_token_id`): look for both spellings
            src = getattr(v, f.name, _MISSING)
            if src is _MISSING:
                src = getattr(v, "_" + f.name, _MISSING)
            names.add(f.name)
            if src is _MISSING:
                if f.required:  # a field this vLLM does not have and we have no default for
                    kwargs[f.name] = None
                continue  # our default
            if hasattr(src, "__call__") and not hasattr(src, "__len__") and not isinstance(src, (int, float, str)):
                continue  # a method of the same name (e.g. a property shadowing): keep our default
            kwargs[f.name] = self._conv(src, f.type)
        theirs = _field_names(v)
        extra = {n.lstrip("_") for n in theirs} - names
        if extra:
            self.unknown_fields.setdefault(type(v).__name__, set()).update(extra)
        return t.cls(**kwargs)


def _accepts(t: mi.Type, v: Any) -> bool:
    """Whether a union member fits the value's kind."""
    if isinstance(t, mi.StructType):
        if t.cls is Array:
            return hasattr(v, "shape") and hasattr(v, "dtype")
        if t.cls is Opaque:
            return True
        return not isinstance(v, (str, int, float, bool, list, dict, tuple, set))
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.TupleType)):
        return isinstance(v, (list, tuple))
    if isinstance(t, (mi.SetType, mi.FrozenSetType)):
        return isinstance(v, (set, frozenset))
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


def to_vllm_sampling_params(ours):
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
