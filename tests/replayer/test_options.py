"""`ReplayOptions`: `--tolerance NAME` and `--atol/--rtol` into one tolerance, or one clear refusal; what Python hands
in checked as the flags are."""

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


def test_knobs_given_from_python_are_checked_as_set_checks_them():
    """A misspelt knob from a script must not replay as if it were unset (MATCH with the knob never applied)."""
    with pytest.raises(UsageError, match="unknown knob 'dtyp'"):
        ReplayOptions(overrides={"dtyp": "bfloat16"})
    with pytest.raises(UsageError, match="a vLLM layout knob; it needs vLLM's runner"):
        ReplayOptions(overrides={"tensor_parallel_size": 2})
    with pytest.raises(UsageError, match="expected a dict"):
        ReplayOptions(overrides=["dtype=bfloat16"])
    assert ReplayOptions(overrides={"threads": 2, "batch_invariant": True}).overrides == {
        "threads": "2", "batch_invariant": "True"}


def test_steps_and_tolerances_from_python_are_checked():
    with pytest.raises(UsageError, match=r"StepRange\.parse"):
        ReplayOptions(steps="0-3")
    with pytest.raises(UsageError, match="expected numbers >= 0"):
        Tolerance(atol=-1e-4)
    with pytest.raises(UsageError, match="expected numbers >= 0"):
        Tolerance(rtol=float("nan"))


def test_knobs_added_as_the_bisects_take_them_go_over_the_options_own():
    opts = ReplayOptions(overrides={"dtype": "bfloat16", "threads": "2"})
    more = opts.with_knobs("threads=1,attention=sdpa", runner="builtin")
    assert more.overrides == {"dtype": "bfloat16", "threads": "1", "attention": "sdpa"}  # (builtin: the default)
    assert opts.overrides == {"dtype": "bfloat16", "threads": "2"}  # (a copy: the options given stay as they were)
    with pytest.raises(UsageError, match="unknown knob 'dtyp'"):
        opts.with_knobs({"dtyp": "float32"})
    with pytest.raises(UsageError, match="say two things"):
        opts.with_knobs({"runner": "builtin"}, runner="vllm")
