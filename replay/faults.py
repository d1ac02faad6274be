"""Faults planted in every forward pass on purpose, to test the diagnosis (`replay explain`, `bisect leak`) against a
known cause: on the builtin runner, and on vLLM's model in every worker (the plugin installs it when the model
loads), so a recording can carry the bug (a server started with it) or only a replay (the variable set for the
replay alone). `REPLAY_TEST_FAULT` names one; nothing reads it outside a model's construction. Never set it outside
tests.

    leak:MODULE:SIZE   each request but the batch's first takes SIZE x the mean of the first's rows of MODULE's
                       output: contamination, a request reading a neighbour's hidden state
    shape:MODULE:SIZE  each request's rows of MODULE's output get SIZE x the batch's token count added to their
                       largest element: batch variance, numbers that follow the batch's shape and not its content
    noise:MODULE:SIZE  each row of MODULE's output gets SIZE x a fresh uniform draw (from the operating system's
                       entropy) added to its largest element: run-to-run nondeterminism, as a GPU kernel that reduces
                       with atomics in whatever order its threads finish (none of this CPU's kernels do)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from replay.errors import UsageError

ENV = "REPLAY_TEST_FAULT"
KINDS = ("leak", "shape", "noise")


def planted_fault() -> tuple[str, str, float] | None:
    """(kind, module, size) from REPLAY_TEST_FAULT, or None when it is not set."""
    text = os.environ.get(ENV, "")
    if not text:
        return None
    kind, _, rest = text.partition(":")
    module, _, size = rest.rpartition(":")
    try:
        if kind not in KINDS or not module:
            raise ValueError
        return kind, module, float(size)
    except ValueError:
        raise UsageError(f"{ENV}={text!r}: expected KIND:MODULE:SIZE, KIND one of "
                         f"{', '.join(KINDS)}") from None


def install_fault(model: Any, spans: Callable[[], list[tuple[int, int]]]) -> Any | None:
    """Hook REPLAY_TEST_FAULT's fault onto `model` (None when it is not set). `spans()`: each scheduled request's
    token rows in the current forward pass, in batch order. Returns the hook's handle."""
    fault = planted_fault()
    if fault is None:
        return None
    import torch

    kind, name, size = fault
    modules = dict(model.named_modules())
    name = _module_named(name, list(modules))

    def hook(module: Any, args: Any, out: Any) -> Any:
        first = out[0] if isinstance(out, tuple) else out
        rows = sorted(spans())
        if not isinstance(first, torch.Tensor) or not rows or first.dim() == 0 or first.shape[0] != rows[-1][1]:
            return None  # not one row per scheduled token
        changed = first.clone()
        flat = changed.view(changed.shape[0], -1)
        if kind == "leak":
            a, b = rows[0]
            source = flat[a:b].mean(dim=0)
            for start, end in rows[1:]:
                flat[start:end] += size * source
        else:
            gen = torch.Generator(device=flat.device).manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
            for start, end in rows:
                cols = flat[start:end].argmax(dim=1)
                step = size * rows[-1][1] if kind == "shape" else \
                    size * torch.rand(end - start, generator=gen, device=flat.device, dtype=flat.dtype)
                flat[torch.arange(start, end, device=flat.device), cols] += step
        return (changed, *out[1:]) if isinstance(out, tuple) else changed

    return modules[name].register_forward_hook(hook)


def _module_named(name: str, names: list[str]) -> str:
    """The module `name` names: itself, or the one module it names under another root (vLLM's Qwen2 holds
    `model.layers.0.mlp` where our engine holds `layers.0.mlp`), so that one REPLAY_TEST_FAULT serves both runs."""
    if name in names:
        return name
    bare = name.removeprefix("model.")
    found = [n for n in names if n == bare or n.endswith(f".{bare}")]
    if len(found) == 1:
        return found[0]
    raise UsageError(f"{ENV}: the model has no module {name!r} (modules are named like "
                     f"{', '.join(n for n in names[1:6])}, ...)" + (f"; it could be {', '.join(found[:3])}"
                                                                   if found else ""))
