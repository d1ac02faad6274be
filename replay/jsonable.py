"""Turn contracts and records into plain JSON values (for `--json` and `export`).

msgspec would write our array-like Structs as bare arrays; people and tools want field names. Arrays become
`{"dtype", "shape", "values"}` with nested lists, and non-finite floats (logprobs of masked tokens are -inf) become
the strings "inf", "-inf" and "nan", since JSON has no spelling for them.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import msgspec
import numpy as np

from replay.contracts import Array


def _float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _values(arr: np.ndarray) -> Any:
    if arr.dtype.kind == "f":
        if np.isfinite(arr).all():
            return arr.tolist()
        return np.vectorize(_float, otypes=[object])(arr).tolist() if arr.size else arr.tolist()
    return arr.tolist()


def to_jsonable(obj: Any) -> Any:
    """A JSON-ready copy of `obj` (Structs, Arrays, sets, enums, dicts with int keys...)."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return obj.name
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return _float(obj)
    if isinstance(obj, Array):
        out = {"dtype": obj.dtype, "shape": list(obj.shape), "values": _values(obj.to_numpy())}
        if obj.dtype == "bfloat16":
            out["note"] = "bfloat16 values are given as their uint16 bit patterns"
        return out
    if isinstance(obj, msgspec.Struct):
        out = {}
        cfg = obj.__struct_config__
        if cfg.tag is not None:
            out[cfg.tag_field] = cfg.tag
        for name in obj.__struct_fields__:
            out[name] = to_jsonable(getattr(obj, name))
        return out
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted((to_jsonable(v) for v in obj), key=lambda v: (str(type(v)), v))
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, bytes):
        return obj.hex()
    raise TypeError(f"cannot express {type(obj).__name__} as JSON")


def dumps(obj: Any) -> str:
    """One compact JSON line for `obj`."""
    return msgspec.json.encode(to_jsonable(obj)).decode()
