"""Batch-invariant mode for the builtin runner: a row's result never depends on how many rows share the call.

A float32 GEMM on CPU can give a row different bits for different numbers of rows M (the kernel is chosen by size;
docs/guide.md, "`replay stress` and the batch-invariant mode"), so the usual batched forward is batch-variant even
though every op is "row-wise". In this mode:
- every linear layer runs on fixed tiles of exactly `TILE` rows (the last tile zero-padded): a row's dot products
  are computed by the same kernel, with the same blocking, whatever else is in the batch;
- attention runs one query token at a time against its own context (the decode path), whatever the attention
  implementation (`batched` included), so neither the batch nor the way a prefill was chunked changes a token's
  attention.
RMSNorm, RoPE, SiLU and the sampler are row-wise already. What it costs: docs/performance.md (bench/engine_bench.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TILE = 4


def _tiled_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    pad = (-n) % TILE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = torch.cat([F.linear(rows[i:i + TILE], module.weight, module.bias) for i in range(0, rows.shape[0], TILE)])
    return out[:n].reshape(*x.shape[:-1], out.shape[-1])


def enable(model: nn.Module) -> None:
    """Make every nn.Linear of `model` batch-invariant (module names and hooks are unchanged)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.forward = (lambda mod: (lambda x: _tiled_linear(mod, x)))(m)
