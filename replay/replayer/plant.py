"""Planting a divergence: add a chosen amount to one module's output, for one request, at one replayed step.

`--plant STEP:REQUEST:MODULE:SIZE` (e.g. `12:req-3:layers.2.mlp.down_proj:1e-3`: add 1e-3 to the largest element
of each of that module's output rows for request req-3 at step 12) lets a user check that their
pipeline catches what it should, and lets the tests prove the diff finds exactly what was planted. The planted step
is executed twice by the replayer: once with the perturbation (its outputs are the ones compared) and once clean
after restoring the runner's state, so the KV cache and generators carry no trace of it and, in forced mode, no
other step can differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from replay.errors import UsageError

if TYPE_CHECKING:
    from replay.engine.runner import ModelRunner


class Plant(msgspec.Struct, frozen=True):
    """Where and how much to perturb."""

    step: int
    request: str  # external or internal request id
    module: str  # a module name of the model, e.g. "layers.2.mlp.down_proj", "norm", "lm_head"
    size: float  # added to the largest element of each of the module's output rows of that request

    @classmethod
    def parse(cls, text: str) -> "Plant":
        """STEP:REQUEST:MODULE:SIZE (the request id may itself contain ':' characters)."""
        parts = text.split(":")
        try:
            if len(parts) < 4:
                raise ValueError
            return cls(int(parts[0]), ":".join(parts[1:-2]), parts[-2], float(parts[-1]))
        except ValueError:
            raise UsageError(f"--plant {text!r}: expected STEP:REQUEST:MODULE:SIZE, e.g. 12:req-3:layers.1.mlp:1e-3") from None


def install(plant: Plant, runner: ModelRunner, internal_id: str) -> Any:
    """Register the perturbing forward hook on the builtin runner's model; returns the handle to remove it."""
    import torch

    modules = dict(runner.model.named_modules())
    if plant.module not in modules:
        names = [n for n in modules if n][:8]
        raise UsageError(f"--plant: the model has no module {plant.module!r} (modules are named like {', '.join(names)}, ...)")

    def hook(module, args, output):
        if not isinstance(output, torch.Tensor):
            return output
        # Only the largest element of each row moves: a constant added to a whole row of logits would vanish in
        # the log-softmax, another element may be one nothing downstream can see (the logit of a token of
        # probability 1e-10), and a fault rarely hits every element alike.
        out = output.clone()
        flat = out.view(out.shape[0], -1)
        if plant.module == "lm_head":  # one row per request, in batch order
            rows = torch.tensor([i for i, r in enumerate(runner.current_rows) if r == internal_id], dtype=torch.long)
        else:
            start, end = runner.current_spans[internal_id]
            rows = torch.arange(start, end)
        cols = flat[rows].argmax(dim=1)
        flat[rows, cols] += plant.size
        return out

    return modules[plant.module].register_forward_hook(hook)
