"""Aggregating beyond a pixel's worth: the report never sends more columns than a plot has pixels.

Steps are binned into at most MAX_COLUMNS columns of consecutive steps (a column is one step when the run is
short), requests into at most MAX_ROWS rows of consecutive requests in arrival order. Each plot keeps what a
reader must not miss in a bin: the largest |Δlogprob| of a heat-map cell, the mean and the peak of a timeline
column, the count of preemptions and prefix hits. |Δlogprob| goes on a log scale, quantised to a byte per cell.
"""

from __future__ import annotations

import base64
import math

import numpy as np

MAX_COLUMNS = 1200  # about the width of the plots in CSS pixels: one column per pixel at most
MAX_ROWS = 400  # heat-map rows; beyond this, consecutive requests share a row
# heat-map cell codes (one byte per cell): below FIRST_LEVEL a state, from it a quantised log10 |Δlogprob|
NOT_SCHEDULED, EQUAL, NOT_COMPARED, FIRST_LEVEL, LAST_LEVEL = 0, 1, 2, 3, 254


def bin_starts(n: int, limit: int) -> np.ndarray:
    """The first item of each of min(n, limit) bins splitting n items as evenly as possible: bin c holds the items
    p with floor(p * k / n) == c (`bin_of`), which start at ceil(c * n / k)."""
    k = max(1, min(n, limit))
    return (np.arange(k, dtype=np.int64) * n + k - 1) // k


def bin_of(positions: np.ndarray | int, n: int, limit: int) -> np.ndarray:
    """The bin (of `bin_starts(n, limit)`) each position falls in."""
    k = max(1, min(n, limit))
    return (np.asarray(positions, dtype=np.int64) * k) // max(n, 1)


def reduce_bins(values: np.ndarray, starts: np.ndarray, how: str) -> np.ndarray:
    """`values` reduced over each bin: "sum", "max" or "mean"."""
    if len(values) == 0:
        return np.zeros(0)
    if how == "max":
        return np.maximum.reduceat(values, starts)
    sums = np.add.reduceat(values.astype(np.float64), starts)
    if how == "sum":
        return sums
    sizes = np.diff(np.append(starts, len(values)))
    return sums / sizes


class LogScale:
    """|Δlogprob| on a log10 scale spanning the decades of the values seen, quantised to FIRST_LEVEL..LAST_LEVEL;
    a zero (a token flip with equal logprobs, a missing output) takes the lowest level."""

    def __init__(self, values: np.ndarray, floor: float = 0.0) -> None:
        """`floor` > 0 (the comparison's atol): the scale starts there, so the colours say how far past the
        tolerance a cell is; what lies below it (a token flip at a tie) takes the lowest level."""
        pos = values[values > 0]
        lo = math.floor(math.log10(pos.min())) if len(pos) else -6
        hi = math.ceil(math.log10(pos.max())) if len(pos) else 0
        if floor > 0:
            lo = math.floor(math.log10(floor))
        self.lo, self.hi, self.floor = lo, max(hi, lo + 1), floor

    def levels(self, values: np.ndarray) -> np.ndarray:
        """The byte code of each value."""
        with np.errstate(divide="ignore"):
            x = np.log10(np.where(values > 0, values, 10.0 ** self.lo))
        frac = (x - self.lo) / (self.hi - self.lo)
        out = np.clip(FIRST_LEVEL + np.rint(frac * (LAST_LEVEL - FIRST_LEVEL)), FIRST_LEVEL, LAST_LEVEL)
        if self.floor > 0:  # the lowest level means "within the tolerance", and nothing else
            out = np.where(values > self.floor, np.maximum(out, FIRST_LEVEL + 1), FIRST_LEVEL)
        return out.astype(np.uint8)


def b64(a: np.ndarray) -> str:
    """A uint8 array as base64 text (what the page decodes into a typed array)."""
    return base64.b64encode(np.ascontiguousarray(a, dtype=np.uint8).tobytes()).decode()


def rounded(a: np.ndarray, digits: int = 3) -> list[float | int]:
    """A compact JSON list: integers stay integers, other values keep `digits` decimals."""
    if a.dtype.kind in "iub":
        return a.astype(np.int64).tolist()
    r = np.round(a.astype(np.float64), digits)
    return [int(v) if v == int(v) else v for v in r.tolist()]
