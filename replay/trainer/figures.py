"""The figures RL teams log for a training-inference mismatch, from per-token differences: mean and max |Δ|, the k3
KL estimator, what a truncated-importance-sampling clip at C would touch, Δ by position, the worst tokens."""

from __future__ import annotations

import msgspec
import numpy as np


class Figures(msgspec.Struct):
    """Over a set of tokens: Δ = trainer - vLLM (logprobs, or logits where vLLM returned logits)."""

    tokens: int
    sequences: int
    mean_abs: float
    max_abs: float
    # KL(vLLM || trainer) by the k3 estimator over vLLM's samples: mean of r - 1 - log r, r = exp(Δ) (None: logits)
    k3: float | None
    clip: float  # C of the truncated importance sampling clip min(r, C)
    clipped_tokens: int  # tokens with r = p_trainer / p_vLLM > C
    clipped_sequences: int  # sequences with at least one


class Bucket(msgspec.Struct):
    """Δ over the output positions [first, last]."""

    first: int
    last: int
    tokens: int
    mean_abs: float
    max_abs: float


def figures(deltas: list[np.ndarray], clip: float, logprobs: bool = True) -> Figures:
    """`deltas`: one array of Δ per sequence, in output order."""
    flat = np.concatenate(deltas) if deltas else np.zeros(0)
    if not flat.size:
        return Figures(0, len(deltas), 0.0, 0.0, None, clip, 0, 0)
    a = np.abs(flat)
    k3 = None
    clipped = seqs = 0
    if logprobs:
        r = np.exp(flat.astype(np.float64))
        k3 = float(np.mean(r - 1 - flat))
        clipped = int((r > clip).sum())
        seqs = sum(bool((np.exp(d.astype(np.float64)) > clip).any()) for d in deltas)
    return Figures(int(flat.size), len(deltas), float(a.mean()), float(a.max()), k3, clip, clipped, seqs)


def by_position(deltas: list[np.ndarray]) -> list[Bucket]:
    """|Δ| by output position, in buckets that double: 0, 1, 2-3, 4-7, ..."""
    out = []
    longest = max((len(d) for d in deltas), default=0)
    first = 0
    while first < longest:
        last = 0 if first == 0 else 2 * first - 1
        parts = [np.abs(d[first:last + 1]) for d in deltas if len(d) > first]
        a = np.concatenate(parts)
        out.append(Bucket(first, min(last, longest - 1), int(a.size), float(a.mean()), float(a.max())))
        first = last + 1
    return out



class Bin(msgspec.Struct):
    """Tokens whose |Δ| lies in [low, high)."""

    low: float
    high: float
    tokens: int


def histogram(deltas: list[np.ndarray]) -> list[Bin]:
    """|Δ| by decade, from the decade of the smallest nonzero |Δ| to that of the largest; exact zeros first."""
    flat = np.abs(np.concatenate(deltas)) if deltas else np.zeros(0)
    if not flat.size:
        return []
    out = [Bin(0.0, 0.0, int((flat == 0).sum()))]
    nonzero = flat[flat > 0]
    if nonzero.size:
        lo, hi = int(np.floor(np.log10(nonzero.min()))), int(np.floor(np.log10(nonzero.max())))
        for e in range(lo, hi + 1):
            a, b = 10.0 ** e, 10.0 ** (e + 1)
            out.append(Bin(a, b, int(((nonzero >= a) & (nonzero < b)).sum())))
    return out
