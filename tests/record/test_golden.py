"""The builtin engine still produces the committed golden captures, token for token."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from replay.inspect import capture_info

CAPTURES = Path(__file__).resolve().parents[2] / "captures"
spec = importlib.util.spec_from_file_location("regenerate", CAPTURES / "regenerate.py")
regenerate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(regenerate)


@pytest.mark.parametrize("name", sorted(regenerate.GOLDEN))
def test_committed_golden_capture_is_intact_and_matches_its_json(name):
    path = CAPTURES / f"{name}.capture"
    info = capture_info(path)
    assert info.complete and not info.damage
    assert regenerate.expected(path) == json.loads((CAPTURES / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(regenerate.GOLDEN))
def test_engine_still_produces_the_golden_outputs(name, tmp_path):
    want = json.loads((CAPTURES / f"{name}.json").read_text())
    got = regenerate.expected(regenerate.record_golden(name, tmp_path))
    assert got["outputs"] == want["outputs"]
    assert [s["sampled"] for s in got["steps"]] == [s["sampled"] for s in want["steps"]]
    for a, b in zip(got["steps"], want["steps"]):  # logprobs: bitwise here, a little slack across CPU kernels
        for rid in b["logprobs"]:
            np.testing.assert_allclose(a["logprobs"][rid], b["logprobs"][rid], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", sorted(regenerate.GOLDEN))
def test_committed_golden_capture_replays_on_any_x86_64_machine(name, record_property):
    """The numerics regression test `git bisect run` uses, as `replay check --tolerance auto` runs it: bitwise
    where this machine's hardware is the recording's, else equal tokens and logprobs within the measured
    cross-hardware tolerance. The suite's summary says which applied (tests/conftest.py)."""
    from replay.replayer import ReplayOptions, check_capture

    res = check_capture(CAPTURES / f"{name}.capture", ReplayOptions(auto_tolerance=True))
    record_property("tolerance", f"golden {name}: {res.report.tolerance_choice if res.report else res.reason}")
    assert res.code == 0, res.reason
