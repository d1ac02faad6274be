"""`REPLAY_TEST_FAULT`: a bug planted in every forward pass, present when the capture was recorded (an engine with
the bug) or only in the replay, and what the diagnosis makes of it on the builtin runner.

Twins `a` and `b` (one prompt, greedy; `testbed.twins`): `a` is the sixth request of a batch at step 0, after
n0..n4, `b` arrives later. A leak (`a` takes a multiple of the batch's first request's hidden state) is
CONTAMINATION naming n0 and the module, exit 1; a fault of the batch's shape alone is BATCH VARIANCE, exit 0, and
`bisect leak` finds nothing. Noise (a fresh draw in every forward pass, as a GPU kernel reducing with atomics)
is RUN-TO-RUN: noise, exit 0, unless batch-invariant mode (ours or vLLM's variable) promised bitwise repeats."""

from __future__ import annotations

import pytest

from replay.bisect.explain_divergence import RUN_TO_RUN, explain_divergence
from replay.bisect.explain_pair import BATCH_VARIANCE, explain_pair
from replay.bisect.leak import CONTAMINATION, NO_LEAK, bisect_leak
from replay.bisect.promise import determinism_promise
from replay.cli import main
from replay.errors import UsageError
from replay.faults import ENV, _module_named, planted_fault
from replay.replayer import ReplayOptions, replay_capture
from testbed.twins import record_twins

LEAK = "leak:layers.0.mlp:0.05"
SHAPE = "shape:layers.1.mlp:1e-4"
NOISE = "noise:layers.1.mlp:1e-3"


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return record_twins(tmp_path_factory.mktemp("clean") / "clean.capture")


@pytest.fixture(scope="module")
def leaky(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, LEAK)
        return record_twins(tmp_path_factory.mktemp("leaky") / "leaky.capture")


def test_a_capture_recorded_with_a_leak_replays_with_it_and_explains_as_contamination(leaky, monkeypatch, capsys):
    monkeypatch.setenv(ENV, LEAK)
    assert not replay_capture(leaky, ReplayOptions()).diverged  # the engine's bug is in the replay too: bitwise
    code = main(["explain", str(leaky), "--pairs", "-q"])
    out = capsys.readouterr().out
    assert code == 1 and f"\n{CONTAMINATION}: requests a and b are bitwise equal alone" in out, out
    assert "moves when n0 is given other tokens" in out and "first at layers.0.mlp" in out


def test_a_leak_only_in_the_replay_is_contamination_too(clean, monkeypatch):
    monkeypatch.setenv(ENV, "leak:model.layers.0.mlp:0.05")  # vLLM's Qwen2 name for our `layers.0.mlp`: one serves both
    res = explain_pair(clean, "a", "b")
    assert res.found == CONTAMINATION and res.bug and res.leak.minimal_set == ["n0"], res.verdict


def test_a_fault_of_the_batchs_shape_is_batch_variance_never_contamination(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, SHAPE)
    path = record_twins(tmp_path / "shape.capture")
    res = explain_pair(path, "a", "b")
    assert res.found == BATCH_VARIANCE and not res.bug and res.alone_equal, res.verdict
    assert bisect_leak(path, 0, "a").found == NO_LEAK


def test_a_fault_it_cannot_read_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(ENV, "spill:layers.0.mlp:1")
    with pytest.raises(UsageError, match="expected KIND:MODULE:SIZE, KIND one of leak, shape, noise"):
        planted_fault()


def test_a_module_name_is_taken_under_either_root_and_refused_where_it_names_none_or_several():
    names = ["", "layers", "layers.0", "layers.0.mlp", "layers.1.mlp", "norm"]
    assert _module_named("model.layers.0.mlp", names) == "layers.0.mlp"
    assert _module_named("layers.0.mlp", ["", "model", "model.layers.0.mlp"]) == "model.layers.0.mlp"
    with pytest.raises(UsageError, match="no module 'layers.7.mlp'"):
        _module_named("layers.7.mlp", names)
    with pytest.raises(UsageError, match="it could be a.mlp, b.mlp"):
        _module_named("mlp", ["", "a.mlp", "b.mlp"])


def test_a_replay_that_does_not_repeat_itself_is_run_to_run_a_bug_only_where_determinism_was_promised(
        clean, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ENV, NOISE)  # an engine with the fault: its twins answered differently
    noisy = record_twins(tmp_path / "noisy.capture")
    invariant = record_twins(tmp_path / "invariant.capture", batch_invariant=True)
    code = main(["explain", str(clean), "-q"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith(f"{RUN_TO_RUN}: the replay does not repeat itself"), out
    assert "nothing here promises bitwise repeats" in out
    res = explain_divergence(clean, ReplayOptions(overrides={"batch_invariant": "true"}))
    assert res.found == RUN_TO_RUN and res.bug and "--set batch_invariant=true promises" in res.verdict, res.verdict

    pair = explain_pair(noisy, "a", "b")
    assert pair.found == RUN_TO_RUN and not pair.bug and "two answers in two replays" in pair.verdict, pair.verdict
    pair = explain_pair(invariant, "a", "b")
    assert pair.found == RUN_TO_RUN and pair.bug, pair.verdict
    assert "the recording's batch-invariant mode promises bitwise repeats, so this is a bug" in pair.verdict


def test_vllms_batch_invariant_variable_in_the_recording_promises_determinism(tmp_path, monkeypatch):
    """vLLM's batch-invariant kernels need Triton (a GPU), so the variable is read from a builtin recording's header
    here: the promise is the header's, whichever runner replays it."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    path = record_twins(tmp_path / "promised.capture")
    assert determinism_promise(path) == "the recording's VLLM_BATCH_INVARIANT=1"
    assert determinism_promise(path, {"env.VLLM_BATCH_INVARIANT": "0"}) == ""
