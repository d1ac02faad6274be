"""Two runs' module outputs for one request, compared module by module (bitwise, max-abs, ULPs), and the one
sentence that names the first module apart: `bisect layers` compares two runs of a step, `bisect dumps` two
installs' dumps of it."""

from __future__ import annotations

import msgspec
import numpy as np
import torch


class ModuleDiff(msgspec.Struct):
    """One module's output for R, side A against side B."""

    module: str
    equal: bool
    max_abs: float
    max_ulps: float  # in the coarser of the two dtypes
    gathered: bool = False  # sharded across tensor-parallel ranks on a side, compared put back together


class LayersBisect(msgspec.Struct):
    """The answer of `bisect layers`."""

    capture: str
    step: int
    request: str
    against: str
    verdict: str
    first_module: str | None
    modules: list[ModuleDiff]  # in execution order
    runner: str = "builtin"
    notes: list[str] = []  # how the sides were run, and how they differ from the recording
    dump: str | None = None  # the directory `--dump` wrote


_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest distance between two outputs in representable values of the coarser dtype (how many floats of
    that dtype lie between them, across zero too; a NaN on either side is left out)."""
    dtype = a.dtype if torch.finfo(a.dtype).eps >= torch.finfo(b.dtype).eps else b.dtype
    if dtype not in _BITS:
        dtype = torch.float32
    x, y = a.to(dtype).contiguous(), b.to(dtype).contiguous()

    def ordered(t: torch.Tensor) -> np.ndarray:  # the float's bits as integers in the floats' order, as uint64
        i = t.view(_BITS[dtype]).numpy().astype(np.int64)
        low = -(1 << (8 * t.element_size() - 1))  # the bits of -0.0
        return np.where(i >= 0, i, low - i).astype(np.int64).view(np.uint64) ^ np.uint64(1 << 63)  # sign-shifted

    ox, oy = ordered(x), ordered(y)
    u = np.where(ox >= oy, ox - oy, oy - ox).astype(np.float64)  # exact in integers, then a float to report
    u[(x.isnan() | y.isnan()).numpy()] = np.nan
    return float(np.nanmax(u, initial=0.0))


def compare_modules(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]],
                    gathered: set[str] = frozenset()) -> list[ModuleDiff]:
    """Diff two runs' module outputs, in side A's execution order (modules side B lacks are skipped)."""
    other = dict(b)
    out = []
    for name, ta in a:
        tb = other.get(name)
        if tb is None or ta.shape != tb.shape:
            continue
        equal = ta.dtype == tb.dtype and torch.equal(ta, tb)
        diff = 0.0 if equal else float((ta.double() - tb.double()).abs().max())
        out.append(ModuleDiff(name, equal, diff, 0.0 if equal else ulps(ta, tb), name in gathered))
    return out


def module_verdict(head: str, diffs: list[ModuleDiff], same: str, apart: str) -> str:
    """The one sentence that names the first module whose output differs, or says none does: `head` (which request
    at which step), then "is bitwise the same {same}" or "differs {apart} is NAME (max |Δ| ..., ... ULPs)"."""
    first = next((d for d in diffs if not d.equal), None)
    if first is None:
        return f"{head}: every module's output ({len(diffs)} compared) is bitwise the same {same}"
    # 0 ULPs where the outputs differ: two dtypes, the finer side's values rounding to the coarser side's
    ulp = f"{first.max_ulps:.3g} ULPs" if first.max_ulps else "0 ULPs: equal once rounded to the coarser dtype"
    return f"{head}: the first module whose output differs {apart} is {first.module} (max |Δ| {first.max_abs:.3g}, " \
           f"{ulp})"
