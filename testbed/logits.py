"""Logit rows at a real vocabulary shaped as a trained model's: a few dozen likely tokens over a long tail of unlikely
ones (a random-weight model's rows are nearly flat, which no top-p boundary of a trained model looks like)."""

from __future__ import annotations

import torch

QWEN_VOCAB = 151_936


def peaked_logits(rows: int, seed: int, vocab: int = QWEN_VOCAB) -> torch.Tensor:
    """[rows, vocab] float32: standard normal noise, and 32 tokens per row lifted to 10-20 (at temperature 0.7 the
    most likely of them holds ~0.3-0.75 of the mass)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn((rows, vocab), generator=g)
    head = torch.randint(0, vocab, (rows, 32), generator=g)
    return z.scatter_(1, head, 10 + 4 * torch.rand((rows, 32), generator=g) + torch.linspace(6, 0, 32))
