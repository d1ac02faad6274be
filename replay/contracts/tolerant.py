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
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import inspect as mi

from replay.contracts.arrays import Array, Opaque

_MISSING = object()


class TolerantConverter:
    """Converts objects, or their builtins image, into contract Structs; remembers fields it had no place for.

    Each contract type is compiled once into a tree of small closures (one per field and container), so a call
    does no type dispatch: the writer process converts every step of a vLLM capture with it."""

    def __init__(self):
        self.unknown_fields: dict[str, set[str]] = {}
        self._plans: dict[Any, Callable[[Any], Any]] = {}

    def convert(self, value: Any, contract: Any) -> Any:
        """`value` as an instance of `contract` (e.g. `SchedulerOutput[str]`)."""
        fn = self._plans.get(contract)
        if fn is None:
            fn = self._plan(contract)
        return fn(value)

    def prepare(self, *contracts: Any) -> None:
        """Compile the converters for `contracts` now (the first `convert` would otherwise)."""
        for contract in contracts:
            self._plan(contract)

    def _plan(self, contract: Any) -> Callable[[Any], Any]:
        fn = self._plans.get(contract)
        if fn is None:
            fn = self._plans[contract] = self._compile(mi.type_info(contract), {})
        return fn

    def _compile(self, t: mi.Type, seen: dict[int, list]) -> Callable[[Any], Any]:
        """The converter for type `t`; `seen` breaks cycles (a type that contains itself)."""
        key = id(t)
        if key in seen:  # recursive type: call through a cell filled when the outer compile finishes
            cell = seen[key]
            return lambda v: cell[0](v)
        cell = seen[key] = [None]
        fn = cell[0] = self._compile_new(t, seen)
        return fn

    def _compile_new(self, t: mi.Type, seen: dict[int, list]) -> Callable[[Any], Any]:
        if isinstance(t, mi.UnionType):
            options = [(x, self._compile(x, seen)) for x in t.types if not isinstance(x, mi.NoneType)]
            first = options[0][1]

            def union(v):
                if v is None:
                    return None
                for x, f in options:  # the first option that accepts the value's kind
                    if _accepts(x, v):
                        return f(v)
                return first(v)
            return union
        if isinstance(t, mi.StructType):
            if t.cls is Array:
                return _array
            if t.cls is Opaque:
                return _opaque
            return self._compile_struct(t, seen)
        if isinstance(t, (mi.ListType, mi.VarTupleType)):
            it = t.item_type
            if isinstance(it, _PRIMITIVE):
                items = _prim_items  # token ids, request ids: no call per element
            elif _prim_list(it):
                items = _prim_rows  # sampled_token_ids, new_token_ids, block_ids
            else:
                f = self._compile(it, seen)

                def items(v):
                    return [f(x) for x in v]
            as_tuple = isinstance(t, mi.VarTupleType)

            def sequence(v):
                if isinstance(v, str):  # vLLM's `stop: str | list[str]`
                    v = [v]
                elif hasattr(v, "tolist"):  # an ndarray where we keep a list
                    v = v.tolist()
                out = items(v or ())
                return tuple(out) if as_tuple else out
            return sequence
        if isinstance(t, mi.TupleType):
            fs = [self._compile(x, seen) for x in t.item_types]
            return lambda v: tuple(f(x) for x, f in zip(v, fs))
        if isinstance(t, (mi.SetType, mi.FrozenSetType)):
            f = self._compile(t.item_type, seen)
            return lambda v: {f(x) for x in (v or ())}
        if isinstance(t, mi.DictType):
            return self._compile_dict(t, seen)
        if isinstance(t, mi.IntType):
            return int
        if isinstance(t, mi.FloatType):
            return float
        if isinstance(t, mi.BoolType):
            return bool
        if isinstance(t, mi.StrType):
            return str
        if isinstance(t, mi.EnumType):
            cls = t.cls
            return lambda v: cls(v.value if isinstance(v, enum.Enum) else v)
        if isinstance(t, mi.AnyType):
            return _plain
        return lambda v: v

    def _compile_dict(self, t: mi.DictType, seen: dict[int, list]) -> Callable[[Any], Any]:
        if isinstance(t.key_type, _PRIMITIVE) and isinstance(t.value_type, _PRIMITIVE):
            body = dict  # num_scheduled_tokens, req_id_to_index: decoded msgpack has the right kinds
        elif isinstance(t.key_type, _PRIMITIVE) and _prim_list(t.value_type):
            def body(v):
                return {k: list(x) for k, x in v.items()}
        else:
            fk, fv = self._compile(t.key_type, seen), self._compile(t.value_type, seen)

            def body(v):
                return {fk(k): fv(x) for k, x in v.items()}

        def mapping(v):
            if not isinstance(v, dict):  # an object we keep as its field dict (StructuredOutputsParams)
                v = _plain(v)
                if not isinstance(v, dict):
                    return {"repr": v}
            return body(v)
        return mapping

    def _compile_struct(self, t: mi.StructType, seen: dict[int, list]) -> Callable[[Any], Any]:
        cls = t.cls
        fields = [(f.name, "_" + f.name, self._compile(f.type, seen), f.required) for f in t.fields]
        names = [f.name for f in t.fields]
        known = frozenset(names)
        unknown = self.unknown_fields

        def struct(v):
            if isinstance(v, (list, tuple)):  # a NamedTuple's image: fields by position
                v = dict(zip(names, v))
            get = v.get if isinstance(v, dict) else (lambda name, default: getattr(v, name, default))
            kwargs = {}
            for name, private, f, required in fields:
                # vLLM keeps some sampling fields private (`_eos_token_id`): look for both spellings
                src = get(name, _MISSING)
                if src is _MISSING:
                    src = get(private, _MISSING)
                if src is _MISSING:
                    if required:  # a field the source does not have and we have no default for
                        kwargs[name] = None
                    continue  # our default
                if callable(src) and not hasattr(src, "__len__") and not isinstance(src, (int, float, str)):
                    continue  # a method of the same name (e.g. a property shadowing): keep our default
                kwargs[name] = f(src)
            theirs = v if isinstance(v, dict) else _field_names(v)
            if len(theirs) != len(known) or any(n.lstrip("_") not in known for n in theirs):
                extra = {n.lstrip("_") for n in theirs} - known
                if extra:
                    kind = cls.__name__ if isinstance(v, dict) else type(v).__name__
                    unknown.setdefault(kind, set()).update(extra)
            return cls(**kwargs)
        return struct


def _prim_items(v: Any) -> list:
    return list(v)


def _prim_rows(v: Any) -> list:
    return [list(x) for x in v]


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
