"""The diff's rules, each defined once: when two logprobs are equal, how far apart two top-k rows are, the
top1-top2 margin, and whether a token flip is a tie flip or a confident one.

A token flip at a near-tie (the top1-top2 margin below `tie_margin`) is a *tie flip*: numerics noise made visible.
A flip at a large margin is a *confident flip*: something is wrong (wrong KV block, wrong position, a bug).
"Near" means below `tie_margin`, or within twice the logprob noise measured at the same position.
Tolerances default to bitwise (`atol = rtol = 0`); vLLM's own tests compare scheduling modes with rtol 1e-3 and
atol 1e-6.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import msgspec
import numpy as np

from replay.contracts import LogprobsLists

DEFAULT_TIE_MARGIN = 0.05  # nats: a flip whose top1-top2 margin is below this is a tie flip


class Tolerance(msgspec.Struct, frozen=True):
    """When two logprobs count as equal: |a - b| <= atol + rtol * |b| (both 0: the same bits)."""

    atol: float = 0.0
    rtol: float = 0.0
    tie_margin: float = DEFAULT_TIE_MARGIN

    @property
    def bitwise(self) -> bool:
        """True when nothing but identical bits is equal."""
        return self.atol == 0 and self.rtol == 0

    def equal(self, a: np.ndarray, b: np.ndarray) -> bool:
        """Arrays equal within the tolerance (NaN equals NaN)."""
        if a.shape != b.shape:
            return False
        if self.bitwise:
            return a.tobytes() == b.tobytes()
        return bool(np.allclose(a, b, rtol=self.rtol, atol=self.atol, equal_nan=True))


class Row(NamedTuple):
    """One output position's logprobs, in vLLM's layout: column 0 the sampled token, columns 1.. the top-k."""

    ids: np.ndarray  # [k + 1] token ids
    values: np.ndarray  # [k + 1] raw logprobs
    rank: int  # rank of the sampled token (1 = the top token)


def row(lp: LogprobsLists | None, i: int) -> Row | None:
    """Row `i` of a LogprobsLists (None when there is none)."""
    if lp is None or i >= lp.num_rows:
        return None
    return Row(lp.logprob_token_ids.to_numpy()[i], lp.logprobs.to_numpy()[i], int(lp.sampled_token_ranks.to_numpy()[i]))


def margin(r: Row | None) -> float | None:
    """top1 - top2 raw logprob of a row (None without at least two top-k columns)."""
    if r is None or len(r.values) < 3:
        return None
    return float(r.values[1] - r.values[2])


def logprob_diff(a: Row, b: Row) -> tuple[float, bool]:
    """(max |Δlogprob| over the tokens both rows hold, sampled token included; whether the top-k ids changed).
    Tokens only one side ranks among its top k have no counterpart to compare and do not count."""
    other: dict[int, float] = {}
    for t, v in zip(b.ids.tolist(), b.values.tolist()):
        other.setdefault(t, v)
    diffs = [abs(v - other[t]) for t, v in zip(a.ids.tolist(), a.values.tolist()) if t in other]
    finite = [d for d in diffs if not math.isnan(d)]
    return (max(finite) if finite else 0.0), a.ids[1:].tolist() != b.ids[1:].tolist()


def rows_equal(a: Row, b: Row, tol: Tolerance) -> bool:
    """The same token ids and rank, and logprobs equal within the tolerance."""
    return a.ids.tobytes() == b.ids.tobytes() and a.rank == b.rank and tol.equal(a.values, b.values)


def classify(margin_: float | None, tol: Tolerance, noise: float = 0.0) -> str:
    """tie | confident. A flip is a tie flip when its top1-top2 margin is below `tol.tie_margin`, or within twice
    the logprob noise measured at that very position (`noise` = max |Δlogprob| there): the numerics moved the
    logprobs by as much as it took to swap the top two. An unknown margin counts as confident."""
    if margin_ is None:
        return "confident"
    return "tie" if margin_ < tol.tie_margin or margin_ <= 2 * noise else "confident"
