"""Binning beyond a pixel's worth keeps what a reader must not miss: a column's peak is its largest step, its mean
times its width is its sum, and |Δlogprob| maps onto the byte scale monotonically, zero at the bottom."""

from __future__ import annotations

import numpy as np

from replay.report.bins import (
    FIRST_LEVEL,
    LAST_LEVEL,
    MAX_COLUMNS,
    LogScale,
    bin_of,
    bin_starts,
    reduce_bins,
)


def test_columns_partition_the_steps_and_keep_peaks_and_sums():
    rng = np.random.default_rng(0)
    for n in (1, 7, MAX_COLUMNS, MAX_COLUMNS + 1, 100_000):
        v = rng.integers(0, 1000, n)
        starts = bin_starts(n, MAX_COLUMNS)
        assert len(starts) == min(n, MAX_COLUMNS) and starts[0] == 0 and (np.diff(starts) > 0).all()
        cols = bin_of(np.arange(n), n, MAX_COLUMNS)
        assert (np.searchsorted(starts, np.arange(n), side="right") - 1 == cols).all()  # each step in its column
        assert reduce_bins(v, starts, "max").tolist() == [v[cols == c].max() for c in range(len(starts))]
        sizes = np.diff(np.append(starts, n))
        assert np.isclose((reduce_bins(v, starts, "mean") * sizes).sum(), v.sum())


def test_the_log_scale_is_monotone_and_spans_the_decades_seen():
    d = np.array([0.0, 3e-7, 1e-6, 4e-4, 2e-2, 0.9])
    scale = LogScale(d)
    assert (scale.lo, scale.hi) == (-7, 0)
    levels = scale.levels(d)
    assert levels[0] == levels[1] == FIRST_LEVEL or levels[0] == FIRST_LEVEL
    assert (np.diff(levels.astype(int)) >= 0).all() and levels.max() <= LAST_LEVEL
    assert LogScale(np.zeros(3)).levels(np.zeros(3)).tolist() == [FIRST_LEVEL] * 3
