"""MoE router agreement: for every token whose routing the capture kept, whether the trainer's router picks the
same top-k experts as vLLM's did, per MoE layer (as sets: the order of equal-weight experts is not compared), and
the first layer where they disagree (the question routing replay, R3, asks)."""

from __future__ import annotations

import msgspec
import numpy as np
import torch


class LayerAgreement(msgspec.Struct):
    """One MoE layer: tokens compared, and how many the trainer routed to the same experts."""

    layer: int
    tokens: int
    agree: int
    fraction: float


class RoutingDisagreement(msgspec.Struct):
    """The first token routed otherwise, in the first layer where any is."""

    request: str
    token_index: int  # in prompt + output
    layer: int
    vllm: list[int]
    trainer: list[int]


class RoutingAgreement(msgspec.Struct):
    """Over every token with kept routing."""

    tokens: int
    layers: list[LayerAgreement]
    first_layer: int | None  # the first MoE layer where a token is routed otherwise
    first: RoutingDisagreement | None


class RoutingTally:
    """Accumulates `RoutingAgreement` over rollouts."""

    def __init__(self) -> None:
        self.tokens = 0
        self.counts: dict[int, list[int]] = {}  # layer -> [tokens, agree]
        self.first: RoutingDisagreement | None = None

    def add(self, request: str, routing: dict[int, np.ndarray], experts: torch.Tensor) -> None:
        """`routing`: token index -> vLLM's [layers, top-k]; `experts`: the trainer's [tokens, layers, top-k]."""
        mine = experts.numpy()
        for t, rows in sorted(routing.items()):
            if t >= len(mine):
                continue
            self.tokens += 1
            for layer in range(min(len(rows), mine.shape[1])):
                same = set(rows[layer].tolist()) == set(mine[t, layer].tolist())
                c = self.counts.setdefault(layer, [0, 0])
                c[0] += 1
                c[1] += same
                if not same and (self.first is None or layer < self.first.layer):
                    self.first = RoutingDisagreement(request, t, layer, rows[layer].tolist(),
                                                     mine[t, layer].tolist())

    def result(self) -> RoutingAgreement | None:
        """None where no token's routing was compared."""
        if not self.tokens:
            return None
        layers = [LayerAgreement(k, n, a, a / n) for k, (n, a) in sorted(self.counts.items())]
        return RoutingAgreement(self.tokens, layers, self.first.layer if self.first else None, self.first)
