"""Packed arrays and opaque summaries: how tensors and unrepresentable payloads cross the capture boundary.

vLLM hands us numpy arrays (`LogprobsLists`) and torch tensors (`LogprobsTensors`, prompt embeddings, pooler
outputs). We store them as raw little-endian bytes plus dtype and shape, so float32 logprobs come back bit for bit
and nothing is ever pickled.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

# dtype names follow torch's spelling; the numpy column is the little-endian form the bytes are stored in.
# bfloat16 has no numpy dtype: it is stored as its raw 16-bit patterns and only `to_torch` can rebuild it.
_NUMPY_DTYPES: dict[str, str] = {
    "bool": "|b1",
    "uint8": "|u1",
    "int8": "|i1",
    "int16": "<i2",
    "uint16": "<u2",
    "int32": "<i4",
    "int64": "<i8",
    "float16": "<f2",
    "bfloat16": "<u2",
    "float32": "<f4",
    "float64": "<f8",
}
DTYPES = frozenset(_NUMPY_DTYPES)
NUMPY_DTYPES = _NUMPY_DTYPES  # dtype name -> the little-endian numpy form its bytes are stored in

# Byte-plane shuffle: all first bytes, then all second bytes, ... Random float mantissas do not compress, but
# their exponent bytes and the high bytes of small ints do, once they sit next to each other.
FILTER_SHUFFLE = "shuffle"
# Transpose (2-D only): store column-major. The columns of a logprob matrix are alike (all top-1 values, all
# top-2 ids, ...), so column-major bytes compress about 10 % better.
FILTER_TRANSPOSE = "transpose"


class Array(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A dense array as little-endian bytes. `filters` name reversible byte transforms applied on write."""

    dtype: str  # one of DTYPES (torch spelling)
    shape: tuple[int, ...]  # C order
    data: bytes  # prod(shape) * itemsize bytes, after `filters`
    filters: tuple[str, ...] = ()  # applied in order on write, undone in reverse on read

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return np.dtype(_NUMPY_DTYPES[self.dtype]).itemsize

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    def validate(self) -> None:
        """Raise ValueError if dtype, shape and byte length disagree (checked before any reshape on read)."""
        if self.dtype not in _NUMPY_DTYPES:
            raise ValueError(f"unknown array dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        if len(self.data) != self.size * self.itemsize:
            raise ValueError(f"array of shape {self.shape} {self.dtype} needs {self.size * self.itemsize} bytes, has "
                             f"{len(self.data)}")
        unknown = set(self.filters) - {FILTER_SHUFFLE, FILTER_TRANSPOSE}  # others belong to the capture's step codec
        if FILTER_TRANSPOSE in self.filters and len(self.shape) != 2:
            raise ValueError("the transpose filter needs a 2-D array")
        if unknown:
            raise ValueError(f"unknown array filter(s) {sorted(unknown)}")

    @classmethod
    def from_numpy(cls, arr: np.ndarray, *, shuffle: bool = False, transpose: bool = False) -> Array:
        """Pack a numpy array (any byte order) as little-endian bytes, optionally column-major (`transpose`, 2-D
        only) and byte-plane shuffled (`shuffle`)."""
        arr = np.asarray(arr)
        name = dtype_name(arr.dtype)
        le = arr if arr.flags.c_contiguous and arr.dtype.str == _NUMPY_DTYPES[name] else \
            np.ascontiguousarray(arr, dtype=np.dtype(_NUMPY_DTYPES[name]))  # (the tap's common case needs no copy)
        filters: tuple[str, ...] = ()
        if transpose and shuffle and le.ndim == 2 and le.dtype.itemsize > 1 and le.size:
            # both in one strided copy (byte plane, column, row), not two: the writer packs every chunk's logprob
            # columns this way
            planes = le.view(np.uint8).reshape(le.shape[0], le.shape[1], le.dtype.itemsize).transpose(2, 1, 0)
            return cls(name, tuple(arr.shape), np.ascontiguousarray(planes).tobytes(),
                       (FILTER_TRANSPOSE, FILTER_SHUFFLE))
        if transpose and le.ndim == 2:
            le = np.ascontiguousarray(le.T)
            filters += (FILTER_TRANSPOSE,)
        if shuffle and le.dtype.itemsize > 1 and le.size:
            # a contiguous copy first: tobytes() of the transposed view walks it byte by byte, far slower
            le = np.ascontiguousarray(le.view(np.uint8).reshape(-1, le.dtype.itemsize).T)
            filters += (FILTER_SHUFFLE,)
        return cls(name, tuple(arr.shape), le.tobytes(), filters)

    def to_numpy(self) -> np.ndarray:
        """The array as numpy (a fresh, writable copy). bfloat16 comes back as its uint16 bit patterns."""
        self.validate()
        np_dtype = np.dtype(_NUMPY_DTYPES[self.dtype])
        raw = np.frombuffer(self.data, dtype=np.uint8)
        if FILTER_SHUFFLE in self.filters and np_dtype.itemsize > 1 and self.size:
            raw = raw.reshape(np_dtype.itemsize, -1).T
        out = np.ascontiguousarray(raw).view(np_dtype)
        if FILTER_TRANSPOSE in self.filters:
            out = out.reshape(self.shape[::-1]).T
        out = out.reshape(self.shape)
        return out.astype(out.dtype.newbyteorder("="), copy=True)

    @classmethod
    def from_torch(cls, t: Any, *, shuffle: bool = False) -> Array:
        """Pack a torch tensor (any device); bfloat16 is kept as its exact bit patterns."""
        import torch

        t = t.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            a = cls.from_numpy(t.view(torch.int16).numpy().view(np.uint16), shuffle=shuffle)
            return msgspec.structs.replace(a, dtype="bfloat16")
        return cls.from_numpy(t.numpy(), shuffle=shuffle)

    def to_torch(self) -> Any:
        """The array as a CPU torch tensor with the recorded dtype (bfloat16 included)."""
        import torch

        arr = self.to_numpy()
        if self.dtype == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)

    @classmethod
    def from_any(cls, value: Any, *, shuffle: bool = False) -> Array:
        """Pack a numpy array, torch tensor, or nested list (int64 or float64 then)."""
        if isinstance(value, Array):
            return value
        if type(value).__module__.startswith("torch"):
            return cls.from_torch(value, shuffle=shuffle)
        return cls.from_numpy(np.asarray(value), shuffle=shuffle)

    def equal(self, other: Array) -> bool:
        """Bitwise equality of dtype, shape and values, whatever filters either side used."""
        if self.dtype != other.dtype or tuple(self.shape) != tuple(other.shape):
            return False
        if self.filters == other.filters:
            return self.data == other.data
        return self.to_numpy().tobytes() == other.to_numpy().tobytes()


_NAMES_BY_KIND: dict[tuple[str, int], str] = {
    ("b", 1): "bool", ("u", 1): "uint8", ("i", 1): "int8", ("i", 2): "int16", ("i", 4): "int32", ("i", 8): "int64",
    ("f", 2): "float16", ("f", 4): "float32", ("f", 8): "float64",
    ("u", 2): "uint16",
}


def dtype_name(dt: np.dtype) -> str:
    """Our (torch) name of a numpy dtype, any byte order. ValueError for a dtype a capture cannot hold."""
    name = _NAMES_BY_KIND.get((dt.kind, dt.itemsize))
    if name is None:
        raise ValueError(f"cannot store numpy dtype {dt} in a capture")
    return name


class Opaque(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What we keep of a payload we cannot represent faithfully (multimodal tensors, LoRA objects, connector
    metadata): its type and size, never its bytes and never a pickle. Replay refuses what depends on it."""

    type: str  # fully qualified type name, e.g. "vllm.lora.request.LoRARequest"
    size: int | None = None  # len() or numel() where the object has one
    summary: str = ""  # a short, human-readable description (repr truncated to 200 chars)

    @classmethod
    def of(cls, obj: Any) -> Opaque:
        """Summarise any object without serialising it."""
        t = type(obj)
        size = None
        for attr in ("numel", "__len__"):
            fn = getattr(obj, attr, None)
            if callable(fn):
                try:
                    size = int(fn())
                    break
                except Exception:  # noqa: BLE001 - a summary must never fail the recording
                    pass
        try:
            text = repr(obj)
        except Exception:  # noqa: BLE001 - nor may an object's repr
            text = "<unrepresentable>"
        return cls(f"{t.__module__}.{t.__qualname__}", size, text[:200])
