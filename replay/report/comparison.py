"""`comparison_data`: the divergences of a comparison as the report's plots take them: a steps x requests heat map
of the largest |Δlogprob| per cell, token flips marked; |Δlogprob| against the top1-top2 margin; per-request
numbers for the table. Everything is binned to what the page can show (`replay.report.bins`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from replay.diff import Divergence, Tolerance
from replay.report.bins import (
    EQUAL,
    MAX_COLUMNS,
    MAX_ROWS,
    NOT_COMPARED,
    LogScale,
    b64,
    bin_of,
)
from replay.report.run_facts import RunFacts

SCATTER_W, SCATTER_H = 360, 200  # scatter cells: about one per 2 x 2 CSS pixels
MAX_MARKERS = 20_000  # token-flip markers drawn over the heat map (one per cell at most)
# marker class; 3: missing output or another length, 4: a random draw (no margin classifies it), 0: no flip
FLIP_CLASS = {"tie": 1, "confident": 2, "not-argmax": 2, "draw": 4}
MARGIN_FLOOR = -6  # log10 of the smallest margin the scatter tells apart from zero


@dataclass(slots=True)
class _Points:
    """The divergences as arrays, one entry each."""

    pos: np.ndarray  # step position in the run (RunFacts), not the engine's index
    row: np.ndarray  # request's order in the run
    delta: np.ndarray  # max |Δlogprob|
    margin: np.ndarray  # top1-top2 margin, NaN when unknown
    flip: np.ndarray  # FLIP_CLASS, 0 for a logprob-only divergence


def _points(run: RunFacts, divs: list[Divergence], order: dict[str, int]) -> _Points:
    keep = [d for d in divs if (d.internal_id or d.request_id) in order]
    steps = np.fromiter((d.step for d in keep), np.int64, len(keep))
    pos = np.minimum(np.searchsorted(run.index, steps), max(len(run.index) - 1, 0))
    row = np.fromiter((order[d.internal_id or d.request_id] for d in keep), np.int64, len(keep))
    delta = np.fromiter((d.max_abs_logprob_diff for d in keep), np.float64, len(keep))
    margin = np.fromiter((math.nan if d.margin is None else d.margin for d in keep), np.float64, len(keep))
    flip = np.fromiter((FLIP_CLASS.get(d.flip, 3) if d.kind in ("token", "missing", "length", "drafts") else 0
                        for d in keep), np.int64, len(keep))
    return _Points(pos, row, np.nan_to_num(delta, nan=0.0), margin, flip)


def comparison_data(run: RunFacts, divs: list[Divergence], flipped: dict[str, int] | None, tol: Tolerance) -> dict:
    """The heat map, scatter and per-request columns of a comparison under `tol` (the verdict's: only its
    divergences are painted, on a colour scale that starts at its atol). `divs` carry internal ids of `run`'s
    requests; `flipped` (two recorded runs) gives, per request, the step after which it was not compared."""
    order = {rid: i for i, rid in enumerate(run.requests)}
    p = _points(run, divs, order)
    return {"heatmap": _heatmap(run, p, flipped or {}, tol.atol), "scatter": _scatter(p, tol.tie_margin),
            "per_request": _per_request(len(order), p, divs, order)}


def cell_of(run: RunFacts, step: int, rid: str) -> list[int] | None:
    """[column, row] of the heat-map cell holding engine step `step` of request `rid` (None if not shown)."""
    order = list(run.requests)
    if rid not in run.requests or not len(run.index):
        return None
    n_steps, n_req = len(run.index), len(order)
    return [int(bin_of(run.position(step), n_steps, MAX_COLUMNS)), int(bin_of(order.index(rid), n_req, MAX_ROWS))]


def _heatmap(run: RunFacts, p: _Points, flipped: dict[str, int], atol: float = 0.0) -> dict:
    """Cells: NOT_SCHEDULED, EQUAL where the request ran and nothing differs, NOT_COMPARED after a flip between
    two runs, else the quantised largest |Δlogprob| of the cell. Rows: requests in arrival order, one each up to
    MAX_ROWS; columns: steps, one each up to MAX_COLUMNS."""
    n_steps, reqs = len(run.index), list(run.requests.values())
    n_req = len(reqs)
    cols, rows = max(1, min(n_steps, MAX_COLUMNS)), max(1, min(n_req, MAX_ROWS))
    grid = np.zeros((rows, cols), np.uint8)
    for i, f in enumerate(reqs):
        r = i * rows // n_req
        after = flipped.get(f.rid)
        cut = None if after is None else run.position(after) + 1
        for a, b in f.spans:
            c0, c1 = int(bin_of(a, n_steps, MAX_COLUMNS)), int(bin_of(b, n_steps, MAX_COLUMNS)) + 1
            grid[r, c0:c1] = np.maximum(grid[r, c0:c1], EQUAL)
            if cut is not None and b >= cut:
                c = int(bin_of(max(a, cut), n_steps, MAX_COLUMNS))
                seg = grid[r, c:c1]
                seg[seg == EQUAL] = NOT_COMPARED
    scale = LogScale(p.delta, atol)
    cc, rr = bin_of(p.pos, n_steps, MAX_COLUMNS), bin_of(p.row, n_req, MAX_ROWS)
    np.maximum.at(grid, (rr, cc), scale.levels(p.delta))
    flips = p.flip > 0
    key = np.unique(np.stack([cc[flips], rr[flips], p.flip[flips]], axis=1),
                    axis=0) if flips.any() else np.zeros((0, 3))
    labels = _row_labels([f.name for f in reqs], rows)
    return {"cols": cols, "rows": rows, "cells": b64(grid), "lo": scale.lo, "hi": scale.hi, "atol": atol,
            "requests": n_req,
            "row_labels": labels, "markers": key[:MAX_MARKERS].astype(np.int64).tolist(),
            "not_compared": bool((grid == NOT_COMPARED).any()),
            "markers_dropped": max(0, len(key) - MAX_MARKERS)}


def _row_labels(names: list[str], rows: int) -> list[str]:
    """A label per row: the request's name, or the first and last of the requests sharing the row."""
    n = len(names)
    if n <= rows:
        return names
    starts = [(r * n + rows - 1) // rows for r in range(rows + 1)]  # the first request of each row
    return [f"{names[a]} … {names[b - 1]} ({b - a})" if b - a > 1 else names[a]
            for a, b in zip(starts[:-1], starts[1:])]


def _scatter(p: _Points, tie_margin: float) -> dict:
    """|Δlogprob| (x, log) against the top1-top2 margin (y, log) of every divergence with a known margin, binned
    per class onto SCATTER_W x SCATTER_H cells: [x, y, class (0 logprobs, 1 tie flip, 2 confident flip), count]."""
    known = ~np.isnan(p.margin) & (p.flip < 3)
    d, m, cls = p.delta[known], p.margin[known], p.flip[known]
    xs = LogScale(d)
    pos_m = m[m > 0]
    y0 = max(MARGIN_FLOOR, min(math.floor(math.log10(pos_m.min())) if len(pos_m) else -3,
                               math.floor(math.log10(tie_margin)) - 1 if tie_margin > 0 else -3))
    y1 = max(y0 + 1, math.ceil(math.log10(pos_m.max())) if len(pos_m) else 1)
    with np.errstate(divide="ignore"):
        lx = np.log10(np.where(d > 0, d, 10.0 ** xs.lo))
        ly = np.log10(np.where(m > 0, m, 10.0 ** y0))
    ix = np.clip(((lx - xs.lo) / (xs.hi - xs.lo) * SCATTER_W).astype(np.int64), 0, SCATTER_W - 1)
    iy = np.clip(((ly - y0) / (y1 - y0) * SCATTER_H).astype(np.int64), 0, SCATTER_H - 1)
    cells = []
    for c in (0, 1, 2):
        sel = cls == c
        keys, counts = np.unique(iy[sel] * SCATTER_W + ix[sel], return_counts=True)
        cells += [[int(k % SCATTER_W), int(k // SCATTER_W), c, int(n)] for k, n in zip(keys, counts)]
    return {"w": SCATTER_W, "h": SCATTER_H, "x0": xs.lo, "x1": xs.hi, "y0": y0, "y1": y1, "cells": cells,
            "tie_margin": tie_margin, "shown": int(known.sum()), "logprobs": int((cls == 0).sum()),
            "tie": int((cls == 1).sum()), "confident": int((cls == 2).sum()),
            "no_margin": int(len(p.delta) - known.sum())}


def _per_request(n: int, p: _Points, divs: list[Divergence], order: dict[str, int]) -> dict[str, list]:
    """Per request (in run order): divergences, token flips, the first divergence's step and position, the largest
    |Δlogprob|, the first flip's class."""
    count = np.bincount(p.row, minlength=n) if n else np.zeros(0, np.int64)
    flips = np.bincount(p.row[p.flip > 0], minlength=n) if n else np.zeros(0, np.int64)
    worst = np.zeros(n)
    np.maximum.at(worst, p.row, p.delta)
    first_step: list[int | None] = [None] * n
    first_pos: list[int | None] = [None] * n
    flip_class: list[str | None] = [None] * n
    for d in divs:  # in step order: the first seen is the first
        i = order.get(d.internal_id or d.request_id)
        if i is None:
            continue
        if first_step[i] is None:
            first_step[i], first_pos[i] = d.step, d.position
        if flip_class[i] is None and d.kind in ("token", "missing", "length", "drafts"):
            flip_class[i] = d.flip or d.kind
    return {"divergences": count.tolist(), "flips": flips.tolist(), "first_step": first_step,
            "first_position": first_pos, "max_delta": [float(f"{x:.3g}") for x in worst.tolist()],
            "flip": flip_class}
