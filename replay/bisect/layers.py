"""`bisect_layers`: run step S two ways with forward hooks on every named module and name the first module whose
output for request R differs (bitwise, max-abs, ULPs), and how the difference grows through the layers."""

from __future__ import annotations

import os
from typing import Callable

import msgspec
import numpy as np
import torch

from replay.bisect.session import StepSession
from replay.replayer import Plant, parse_overrides
from replay.replayer.plant import install


class ModuleDiff(msgspec.Struct):
    """One module's output for R, side A against side B."""

    module: str
    equal: bool
    max_abs: float
    max_ulps: float  # in the coarser of the two dtypes


class LayersBisect(msgspec.Struct):
    """The answer of `bisect layers`."""

    capture: str
    step: int
    request: str
    against: str
    verdict: str
    first_module: str | None
    modules: list[ModuleDiff]  # in execution order


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    dtype = a.dtype if torch.finfo(a.dtype).eps >= torch.finfo(b.dtype).eps else b.dtype
    x, y = a.double().numpy(), b.double().numpy()
    spacing = np.spacing(np.abs(x).astype(np.float32 if dtype != torch.float64 else np.float64))
    if dtype in (torch.bfloat16, torch.float16):
        spacing = spacing * (torch.finfo(dtype).eps / torch.finfo(torch.float32).eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.abs(x - y) / np.maximum(spacing, np.finfo(np.float64).tiny)
    return float(np.nanmax(u, initial=0.0))


def compare_modules(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> list[ModuleDiff]:
    """Diff two runs' module outputs, in side A's execution order (modules side B lacks are skipped)."""
    other = dict(b)
    out = []
    for name, ta in a:
        tb = other.get(name)
        if tb is None or ta.shape != tb.shape:
            continue
        equal = ta.dtype == tb.dtype and torch.equal(ta, tb)
        diff = 0.0 if equal else float((ta.double() - tb.double()).abs().max())
        out.append(ModuleDiff(name, equal, diff, 0.0 if equal else _ulps(ta, tb)))
    return out


def bisect_layers(path: str | os.PathLike, step: int, request: str, against: str = "solo", *,
                  plant: Plant | None = None, log: Callable[[str], None] | None = None) -> LayersBisect:
    """Side A: step `step` as recorded. Side B: R alone (`against="solo"`), the same step under other knobs
    (`"dtype=bfloat16,attention=reference"`), and/or with a planted fault (`plant`)."""
    log = log or (lambda msg: None)
    log(f"replaying {path} to step {step} (side A)")
    a_session = StepSession(path, step, log=log)
    rid = a_session.request_id(request)
    a = a_session.run(rid, modules=True)
    keep = None
    if against == "solo":
        b_session = a_session
        keep = {rid}
    elif against in ("", "same", "none"):
        b_session = a_session
    else:
        log(f"replaying {path} to step {step} with {against} (side B)")
        b_session = StepSession(path, step, parse_overrides(against.split(",")), force=True, log=log)
    hooks = [lambda: install(plant, b_session.runner, rid)] if plant is not None else None
    b = b_session.run(rid, keep, hooks=hooks, modules=True)
    diffs = compare_modules(a.modules, b.modules)
    first = next((d for d in diffs if not d.equal), None)
    what = against + (f" + planted {plant.size:g} in {plant.module}" if plant else "")
    if first is None:
        verdict = f"request {request} at step {step}: every module's output is bitwise the same against {what}"
    else:
        verdict = (f"request {request} at step {step}: the first module whose output differs against {what} is "
                   f"{first.module} (max |Δ| {first.max_abs:.3g}, {first.max_ulps:.3g} ULPs)")
    return LayersBisect(str(path), step, request, what, verdict, first.module if first else None, diffs)
