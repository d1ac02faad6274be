"""LoRA adapters on the builtin model: peft-format adapters (adapter_config.json + safetensors) applied per request.

A linear layer an adapter targets computes `W x + (alpha / r) * B (A x)` for the tokens of the requests that use
the adapter, and `W x` for the others (vLLM's punica "shrink then expand", in the same order: x A^T first, then
times B^T, then scaled and added). Forward hooks on the targeted modules add the update to the rows of the flat
token batch that belong to each adapter's requests, so the model itself and the runner's other hooks are unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from replay.errors import UsageError


@dataclass(slots=True)
class Adapter:
    """One adapter's weights, by our module name (`layers.0.self_attn.q_proj`): A [r, in], B [out, r]."""

    name: str
    scale: float  # lora_alpha / r (or / sqrt(r) with use_rslora)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def load_adapter(name: str, path: str | Path, model: nn.Module) -> Adapter:
    """Read a peft LoRA adapter for `model` (its dtype and device); UsageError naming the adapter if it cannot."""
    from safetensors import safe_open

    d = Path(path)
    try:
        cfg = json.loads((d / "adapter_config.json").read_text())
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {d}")
    except (OSError, ValueError) as e:
        raise UsageError(f"LoRA adapter {name!r} ({d}): cannot read it ({e})") from None
    r, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", cfg.get("r", 8)))
    scale = alpha / (r ** 0.5) if cfg.get("use_rslora") else alpha / r
    modules = dict(model.named_modules())
    p = next(model.parameters())
    out = Adapter(name, scale)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                # base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight -> layers.0.self_attn.q_proj, A
                stem, _, which = key.rpartition(".lora_")
                module = stem.removeprefix("base_model.model.").removeprefix("model.")
                pairs.setdefault(module, {})[which.split(".")[0]] = st.get_tensor(key)
    for module, ab in pairs.items():
        if module not in modules or set(ab) != {"A", "B"}:
            raise UsageError(f"LoRA adapter {name!r}: {module} is not a module of this model (or lacks lora_A/B)")
        out.weights[module] = (ab["A"].to(p.dtype).to(p.device), ab["B"].to(p.dtype).to(p.device))
    return out


class LoRAHooks:
    """Forward hooks that add each active adapter's update to its requests' token rows."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self.rows: dict[str, torch.Tensor] = {}  # adapter name -> indices of its tokens in the flat batch
        self._handles: list = []

    def add(self, name: str, path: str) -> None:
        """Load an adapter once (by name) and hook the modules it targets."""
        if name in self.adapters:
            return
        adapter = self.adapters[name] = load_adapter(name, path, self.model)
        modules = dict(self.model.named_modules())
        for module in adapter.weights:
            self._handles.append(modules[module].register_forward_hook(self._hook(name, module)))

    def set_rows(self, rows: dict[str, list[int]], device: torch.device) -> None:
        """The token rows of this step's batch that each adapter applies to."""
        self.rows = {name: torch.tensor(r, dtype=torch.long, device=device) for name, r in rows.items() if r}

    def _hook(self, name: str, module: str):
        def hook(mod: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
            idx = self.rows.get(name)
            if idx is None:
                return None
            a, b = self.adapters[name].weights[module]
            x = inputs[0].index_select(0, idx)
            output.index_add_(0, idx, (x @ a.t()) @ b.t() * self.adapters[name].scale)
            return output
        return hook

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
