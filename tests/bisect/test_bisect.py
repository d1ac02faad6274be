"""Bisecting: planted faults located exactly (step, module); a planted batch-variant op and real fp32 batch variance
found by ddmin; a knob found by ddmin over configurations."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from typer.testing import CliRunner

from replay.bisect.batch import PAD_SIZES, bisect_batch
from replay.bisect.config import bisect_config
from replay.bisect.layers import bisect_layers
from replay.bisect.module_compare import compare_modules, module_verdict
from replay.bisect.steps import bisect_steps
from replay.capture import CaptureReader, RequestAdded, Step, StepRange
from replay.cli import app
from replay.diff import Tolerance
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.errors import UsageError
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic
from replay.replayer import Plant, ReplayOptions


@pytest.fixture(scope="module")
def crowd(tmp_path_factory):
    """12 greedy requests arriving together, 8 at a time: decode steps with many neighbours."""
    wl = SyntheticWorkload(num_requests=12, prompt_len=(8, 24), output_len=(10, 16), arrival_rate=0,
                           sampling="greedy", num_logprobs=2, seed=31)
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=8, num_gpu_blocks=128, max_num_seqs=8,
                                                 max_num_batched_tokens=64), runner=RunnerConfig(num_threads=1))
    path = tmp_path_factory.mktemp("crowd") / "crowd.capture"
    record_builtin(RecordOptions(cfg, synthetic(wl, 512), path))
    ext, steps = {}, []
    with CaptureReader(path) as r:
        for rec in r.records():
            if isinstance(rec, RequestAdded):
                ext[rec.request.request_id] = rec.request.external_req_id
            elif isinstance(rec, Step):
                so = rec.scheduler_output
                if len(so.num_scheduled_tokens) >= 6 and all(n == 1 for n in so.num_scheduled_tokens.values()):
                    steps.append((rec.index, [ext[x] for x in so.num_scheduled_tokens]))
    assert steps, "the workload must produce crowded decode steps"
    return path, steps


def test_planted_faults_are_located_at_their_step_and_module(crowd):
    path, steps = crowd
    modules = ["embed_tokens", "layers.0.self_attn.k_proj", "layers.1.self_attn.attn", "layers.2.mlp.up_proj",
               "layers.3.post_attention_layernorm", "norm", "lm_head", "layers.1.mlp.down_proj"]
    rnd = random.Random(99)
    print("plant seed 99")
    for _ in range(20):
        step, reqs = rnd.choice(steps)
        plant = Plant(step, rnd.choice(reqs), rnd.choice(modules), rnd.choice([1e-3, 0.05, 1.0]))
        found = bisect_steps(path, opts=ReplayOptions(plant=plant, steps=StepRange(0, step + 2)))
        assert found.step == plant.step and found.replay.first_divergence.request_id == plant.request, plant
        layers = bisect_layers(path, step, plant.request, "same", plant=plant)
        assert layers.first_module == plant.module, (plant, layers.first_module)


def test_a_batch_variant_op_is_pinned_on_the_one_neighbour_that_triggers_it(crowd):
    path, steps = crowd
    step, reqs = max(steps, key=lambda s: len(s[1]))
    watched, culprit = reqs[0], reqs[-2]
    holder = {}

    def hook():
        """A module that misbehaves for `watched` whenever `culprit` shares the batch."""
        runner = holder["runner"]
        internal = {v: k for k, v in holder["ext"].items()}

        def fn(module, args, out):
            if internal[culprit] in runner.current_spans:
                a, b = runner.current_spans[internal[watched]]
                out = out.clone()
                out[a:b] += 1e-3
            return out
        return runner.model.get_submodule("layers.1.mlp.down_proj").register_forward_hook(fn)

    import replay.bisect.builtin_session as session_mod

    real_init = session_mod.StepSession.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        holder["runner"], holder["ext"] = self.runner, self.ext

    session_mod.StepSession.__init__ = init
    try:
        # bf16-free fp32 batch variance would also show up; compare within a tolerance that absorbs it (1e-4)
        from replay.diff import Tolerance

        res = bisect_batch(path, step, watched, tol=Tolerance(atol=1e-4), hooks=[hook])
    finally:
        session_mod.StepSession.__init__ = real_init
    assert res.minimal_set == [culprit] and not res.batch_invariant
    n = len(res.neighbours)
    assert res.re_executions <= 2 + len(PAD_SIZES) + 4 * math.ceil(math.log2(n)) + 2, res.re_executions


def test_real_fp32_batch_variance_is_found_in_a_layer_0_linear(crowd):
    path, steps = crowd
    step, reqs = steps[0]
    res = bisect_batch(path, step, reqs[0])
    assert not res.batch_invariant and res.minimal_set and res.max_abs_logit_diff > 0
    layers = bisect_layers(path, step, reqs[0], "solo")
    assert layers.first_module.startswith("layers.0.self_attn.") and layers.first_module.endswith("_proj")


def test_config_bisect_names_dtype(crowd):
    path, _ = crowd
    res = bisect_config(path, "dtype=float32,seed=0", "dtype=bfloat16,seed=5", steps=StepRange(0, 6))
    assert res.minimal_change == {"dtype": "bfloat16"}


def test_steps_of_two_captures_take_the_tolerance_given_and_refuse_replay_settings(crowd, tmp_path):
    """Two recordings are diffed as they are: the options' tolerance is theirs, and knobs or a mode (which only a
    replay of one capture can apply) are refused, never dropped in silence."""
    path, _ = crowd
    other = shutil.copy(path, tmp_path / "other.capture")
    tol = Tolerance(atol=1e-4)
    assert bisect_steps(path, other, opts=ReplayOptions(tolerance=tol)).capture_diff.tolerance == tol
    with pytest.raises(UsageError, match="compares two recordings as they are"):
        bisect_steps(path, other, opts=ReplayOptions(overrides={"dtype": "bfloat16"}))
    for kw, said in (({"auto_tolerance": True}, "--tolerance auto"), ({"repeat": 2}, "--repeat"),
                     ({"force": True}, "--force"), ({"from_start": True}, "--from-start")):
        with pytest.raises(UsageError, match=f"as they are: {said} replay one capture"):
            bisect_steps(path, other, opts=ReplayOptions(**kw))
    with pytest.raises(UsageError, match="two tolerances given"):
        bisect_steps(path, other, opts=ReplayOptions(tolerance=tol), tol=Tolerance(atol=1e-3))
    assert bisect_steps(path, tol=tol, opts=ReplayOptions(steps=StepRange(0, 2))).replay.tolerance == tol


def test_bisect_steps_and_explain_take_knobs_as_the_other_bisects_do(crowd):
    """`overrides` and `runner` from Python, as `bisect_batch` and the rest take them: the same answer as the options'
    own knobs give."""
    from replay.bisect.explain_divergence import explain_divergence

    path, _ = crowd
    as_opts = bisect_steps(path, opts=ReplayOptions(overrides={"dtype": "bfloat16"}))
    as_knobs = bisect_steps(path, overrides="dtype=bfloat16", runner="builtin")
    assert as_opts.step is not None and (as_knobs.step, as_knobs.verdict) == (as_opts.step, as_opts.verdict)
    said = explain_divergence(path, overrides={"dtype": "bfloat16"}, step=as_opts.step)
    assert said.found == explain_divergence(path, ReplayOptions(overrides={"dtype": "bfloat16"}),
                                            step=as_opts.step).found != "NOTHING TO EXPLAIN", said.verdict


def test_config_bisect_refuses_an_engine_argument_the_steps_fix_before_any_replay(crowd, monkeypatch):
    """vLLM's runner would refuse `vllm.max_num_seqs` only as it starts the engine, after the good side's replay
    (~24 s on vLLM's runner): the bisect says so first."""
    pytest.importorskip("vllm")
    import replay.bisect.config as config

    def replayed(*a, **k):
        raise AssertionError("the bisect replayed before refusing")

    monkeypatch.setattr(config, "replay_capture", replayed)
    path, _ = crowd
    with pytest.raises(UsageError, match="vllm.max_num_seqs: a replay runs the recorded steps"):
        bisect_config(path, "runner=vllm", "runner=vllm,vllm.max_num_seqs=4", steps=StepRange(0, 4))
    with pytest.raises(UsageError, match="has no argument 'max_num_seq'"):
        bisect_config(path, "runner=vllm,vllm.max_num_seq=4", "runner=vllm,dtype=bfloat16", steps=StepRange(0, 4))
    with pytest.raises(UsageError, match="two tolerances given"):  # `tol`, as the other bisects name it, or `tolerance`
        bisect_config(path, "", {"dtype": "bfloat16"}, tol=Tolerance(atol=1e-3), tolerance=Tolerance(atol=1e-4))


def test_config_bisect_fanned_out_gives_the_serial_verdict(crowd):
    """Each ddmin round's subsets replay at once as Ray tasks (a local single-node cluster; local processes take
    the same path, see test_corpus): the minimal change is the serial one."""
    from replay.processes.fanout import FanOut

    path, _ = crowd
    args = (path, "dtype=float32,seed=0,threads=1", "dtype=bfloat16,seed=5,threads=2")
    serial = bisect_config(*args, steps=StepRange(0, 4))
    assert serial.minimal_change == {"dtype": "bfloat16"}
    pytest.importorskip("ray")
    on_ray = bisect_config(*args, steps=StepRange(0, 4), how=FanOut(ray=True))
    assert on_ray.minimal_change == serial.minimal_change and on_ray.verdict == serial.verdict


def test_bisect_cli(crowd):
    path, steps = crowd
    step, reqs = steps[0]
    cli = CliRunner()
    res = cli.invoke(app, ["bisect", "steps", str(path)])
    assert res.exit_code == 0 and "no step" in res.stdout
    res = cli.invoke(app, ["bisect", "steps", str(path), "--set", "dtype=bfloat16"])
    assert res.exit_code == 1 and "first to diverge" in res.stdout
    res = cli.invoke(app, ["bisect", "batch", str(path), "--step", str(step), "--request", reqs[0], "-q"])
    assert res.exit_code == 0 and "re-executions" in res.stdout
    res = cli.invoke(app, ["bisect", "layers", str(path), "--step", str(step), "--request", reqs[0], "--json", "-q"])
    assert res.exit_code == 0 and '"first_module"' in res.stdout
    res = cli.invoke(app, ["bisect", "batch", str(path), "--step", str(step), "--request", "nobody", "-q"])
    assert res.exit_code == 2 and "not scheduled" in res.stderr
    res = cli.invoke(app, ["bisect", "config", str(path), "--bad", "seed=3", "--steps", "0-3", "-q"])
    assert res.exit_code == 2 and "replays within tolerance" in res.stderr


def test_an_interrupted_config_bisect_resumes_from_its_state(crowd, tmp_path):
    path, _ = crowd
    state = tmp_path / "state.json"
    calls = []
    import replay.bisect.config as config_mod

    real = config_mod.replay_capture

    def counting(*a, **k):
        calls.append(1)
        if len(calls) == 3 and not state.with_suffix(".done").exists():
            raise KeyboardInterrupt  # the user hits ^C during the third replay
        return real(*a, **k)

    config_mod.replay_capture = counting
    try:
        with pytest.raises(KeyboardInterrupt):
            bisect_config(path, "dtype=float32", "dtype=bfloat16,seed=5", steps=StepRange(0, 4), state=state)
        assert state.exists()
        state.with_suffix(".done").write_text("")
        before = len(calls)
        res = bisect_config(path, "dtype=float32", "dtype=bfloat16,seed=5", steps=StepRange(0, 4), state=state)
    finally:
        config_mod.replay_capture = real
    assert res.minimal_change == {"dtype": "bfloat16"}
    assert len(calls) - before == res.re_executions - 2  # the two results saved before the interrupt were reused


def test_bisect_layers_dumps_both_sides_of_the_first_differing_modules(crowd, tmp_path):
    from safetensors.torch import load_file

    path, steps = crowd
    step, reqs = steps[0]
    plant = Plant(step, reqs[1], "layers.2.mlp.up_proj", 0.5)
    out = CliRunner().invoke(app, ["bisect", "layers", str(path), "--step", str(step), "--request", reqs[1],
                                   "--against", "same", "--plant", f"{step}:{reqs[1]}:layers.2.mlp.up_proj:0.5",
                                   "--dump", str(tmp_path / "d"), "-q"])
    assert out.exit_code == 0 and f"dumped to {tmp_path / 'd'}" in out.output, out.output
    index = json.loads((tmp_path / "d" / "index.json").read_text())
    a, b = load_file(str(tmp_path / "d" / "a.safetensors")), load_file(str(tmp_path / "d" / "b.safetensors"))
    names = [m["name"] for m in index["modules"]]
    assert index["first_module"] == plant.module and names[2] == plant.module and len(names) == 5
    assert [m["equal"] for m in index["modules"]][:3] == [True, True, False]  # the two modules just before it
    assert set(a) == set(b) == set(names) and a[plant.module].shape[0] == 1  # the request's one decode token
    assert float((b[plant.module] - a[plant.module]).abs().max()) == pytest.approx(0.5)
    same = bisect_layers(path, step, reqs[1], "same", dump=tmp_path / "none")
    assert same.first_module is None and json.loads((tmp_path / "none" / "index.json").read_text())["modules"] == []


def test_two_dumps_made_apart_name_the_first_module_that_differs(crowd, tmp_path):
    """`--dump-all` in two environments (here one variable apart, as two installs would be), then `bisect dumps`."""
    from replay.bisect.dump import compare_dumps

    path, steps = crowd
    step, reqs = steps[0]
    base = bisect_layers(path, step, reqs[0], "same", dump=tmp_path / "base", dump_all=True)
    other = bisect_layers(path, step, reqs[0], "same", overrides={"env.MKL_CBWR": "COMPATIBLE"},
                          dump=tmp_path / "other", dump_all=True)
    assert base.first_module is None and other.first_module is None  # each side against itself
    index = json.loads((tmp_path / "base" / "index.json").read_text())
    assert len(index["modules"]) == len(base.modules) and index["computed_by"]["runner"] == "builtin"
    same = compare_dumps(tmp_path / "base", tmp_path / "base")
    assert same.first_module is None and "bitwise the same" in same.verdict
    res = compare_dumps(tmp_path / "base", tmp_path / "other")
    if res.first_module is None:
        pytest.skip("MKL_CBWR=COMPATIBLE runs the same GEMM code path on this CPU: nothing to find")
    names = [m.module for m in res.modules]
    assert all(m.equal for m in res.modules[:names.index(res.first_module)]) and res.modules[0].equal
    out = CliRunner().invoke(app, ["bisect", "dumps", str(tmp_path / "base"), str(tmp_path / "other")])
    assert out.exit_code == 0 and f"is {res.first_module}" in out.output
    bad = CliRunner().invoke(app, ["bisect", "dumps", str(tmp_path / "base"), str(tmp_path)])
    assert bad.exit_code == 2 and "not a dump of" in bad.output


def test_ulps_count_the_floats_between_two_outputs_across_zero_too():
    """ULPs are representable values of the coarser dtype between the two sides: 1 for neighbours, 2 for the
    smallest subnormals either side of zero, at most 65,535 in bfloat16 (never the 1e37 a spacing taken at zero
    gives), NaN pairs left out."""
    import torch

    from replay.bisect.module_compare import ulps as _ulps

    f32, bf16 = torch.float32, torch.bfloat16
    assert _ulps(torch.tensor([1.0]), torch.tensor([1.0 + 2**-23])) == 1
    f64 = torch.float64
    assert _ulps(torch.tensor([1.0], dtype=f64), torch.tensor([1.0 + 2**-52], dtype=f64)) == 1  # integers, not floats
    assert _ulps(torch.tensor([1e-45]), torch.tensor([-1e-45])) == 2 and _ulps(torch.tensor([0.0]),
                                                                               torch.tensor([-0.0])) == 0
    assert _ulps(torch.tensor([0.0], dtype=bf16), torch.tensor([1e-3], dtype=bf16)) < 2**16
    assert _ulps(torch.tensor([1.0], dtype=f32), torch.tensor([1.0078125], dtype=bf16)) == 1  # in bfloat16's units
    assert _ulps(torch.tensor([float("nan"), 2.0]), torch.tensor([float("nan"), 2.0])) == 0


def test_outputs_that_differ_only_by_rounding_to_the_coarser_dtype_say_so():
    """float32 against bfloat16: every module differs, and at the first the difference is bfloat16's rounding."""
    a = torch.tensor([1.0001, 2.5, -3.0])
    [same] = compare_modules([("embed", a)], [("embed", a.to(torch.bfloat16))])
    assert not same.equal and same.max_abs > 0 and same.max_ulps == 0
    said = module_verdict("request r at step 0", [same], "", "against dtype=bfloat16")
    assert said.endswith("is embed (max |Δ| 0.0001, 0 ULPs: equal once rounded to the coarser dtype)"), said
    [apart] = compare_modules([("embed", a)], [("embed", (a + 0.5).to(torch.bfloat16))])
    assert module_verdict("r", [apart], "", "x").endswith(f"{apart.max_ulps:.3g} ULPs)") and apart.max_ulps > 0
