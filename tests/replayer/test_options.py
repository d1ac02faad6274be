"""`ReplayOptions.tolerance_from`: `--tolerance NAME` and `--atol/--rtol` into one tolerance, or one clear refusal."""

from __future__ import annotations

import pytest

from replay.diff import Tolerance
from replay.errors import UsageError
from replay.replayer.options import ReplayOptions


def test_numbers_alone_are_the_tolerance_and_bitwise_is_zero():
    assert ReplayOptions.tolerance_from(None, 1e-4, 0.01) == (Tolerance(1e-4, 0.01), False)
    assert ReplayOptions.tolerance_from("bitwise") == (Tolerance(0.0, 0.0), False)


def test_auto_decides_the_numbers_itself():
    tol, auto = ReplayOptions.tolerance_from("auto")
    assert auto and tol == Tolerance(0.0, 0.0)
    with pytest.raises(UsageError, match="--tolerance auto decides the tolerance itself"):
        ReplayOptions.tolerance_from("auto", atol=1e-3)


def test_an_unknown_name_is_refused_with_the_names_there_are():
    with pytest.raises(UsageError, match="--tolerance loose: use auto or bitwise"):
        ReplayOptions.tolerance_from("loose")
