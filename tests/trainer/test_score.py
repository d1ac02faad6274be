"""`replay trainer` on builtin-engine captures of a Qwen2 with the real vocabulary (151,936 ids), in each of vLLM's
four `logprobs_mode`s: the trainer (real `transformers`, the same checkpoint) agrees like for like at the rounding
level in float32; raw logprobs of a tempered request and processed logprobs after top-p are a difference of meaning,
named and not counted; a penalty before processed logprobs, a request without logprobs, are set aside by name;
bfloat16 is held to bfloat16's rounding. The builtin engine samples in vLLM's order and returns each mode
as vLLM does, so its captures stand in for vLLM's here (vLLM's server: tests/integrations/vllm/test_server.py)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

pytest.importorskip("transformers")

from replay.capture.writing.writer_process import ProcessCaptureWriter  # noqa: E402
from replay.cli import main  # noqa: E402
from replay.cli.render_trainer import render_trainer  # noqa: E402
from replay.contracts import EngineCoreRequest, SamplingParams  # noqa: E402
from replay.engine.config import LOGPROBS_MODES, EngineConfig, RunnerConfig, SchedulerConfig  # noqa: E402
from replay.engine.engine import LLMEngine  # noqa: E402
from replay.record import RecordOptions, WorkloadRequest, record_builtin  # noqa: E402
from replay.record.tap import CaptureTap  # noqa: E402
from replay.replayer import ReplayOptions, replay_capture  # noqa: E402
from replay.trainer import TrainerOptions, score_capture  # noqa: E402
from testbed.checkpoints import real_vocab_qwen2  # noqa: E402
from tests.report.chromium import load, needs_chromium  # noqa: E402

PROMPT = [11, 2000, 70000, 151000, 5, 9, 13]


def _workload() -> list[WorkloadRequest]:
    def req(name: str, **sp) -> WorkloadRequest:
        return WorkloadRequest(SamplingParams(**{"max_tokens": 8, "ignore_eos": True, **sp}), None,
                               [t + len(name) for t in PROMPT], name, 0)

    return [req("greedy", temperature=0.0, logprobs=3), req("tempered", temperature=0.7, seed=1, logprobs=2),
            req("top-p", temperature=0.7, top_p=0.9, seed=2, logprobs=1),
            req("top-k", temperature=1.0, top_k=20, seed=3, logprobs=1),
            req("penalised", temperature=1.0, repetition_penalty=1.3, seed=4, logprobs=1),
            req("quiet", temperature=1.0, seed=5)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return real_vocab_qwen2(tmp_path_factory.mktemp("trainer") / "qwen2-vocab")


@pytest.fixture(scope="module")
def captures(qwen, tmp_path_factory):
    """One capture per logprobs mode (float32), and one in bfloat16."""
    d = tmp_path_factory.mktemp("modes")
    out = {}
    for mode, dtype in [(m, "float32") for m in LOGPROBS_MODES] + [("raw_logprobs", "bfloat16")]:
        path = d / f"{mode}-{dtype}.capture"
        cfg = EngineConfig(model=str(qwen), scheduler=SchedulerConfig(block_size=16, num_gpu_blocks=64),
                           runner=RunnerConfig(dtype=dtype, num_threads=1, logprobs_mode=mode))
        record_builtin(RecordOptions(cfg, _workload(), path))
        out[mode if dtype == "float32" else dtype] = path
    return out


PARENT = "cmpl-a934e848e6489fa3-0"  # an OpenAI server's id, as vLLM's front end names an n=2 request's children


@pytest.fixture(scope="module")
def fanned(qwen, tmp_path_factory):
    """An n=2 request as vLLM's front end hands it to the engine core: two children `{index}_{parent's internal id}`
    under the parent's user id (shown `{user id}#{index}`), each with logprobs."""
    path = tmp_path_factory.mktemp("fanned") / "n2.capture"
    cfg = EngineConfig(model=str(qwen), scheduler=SchedulerConfig(block_size=16, num_gpu_blocks=64),
                       runner=RunnerConfig(dtype="float32", num_threads=1))
    engine = LLMEngine(cfg)
    writer = ProcessCaptureWriter(path, engine.header())
    engine.listeners.append(CaptureTap(writer))
    sp = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.7, logprobs=2)
    for i in range(2):
        engine.add_engine_core_request(EngineCoreRequest(f"{i}_{PARENT}-8fbb1136", PROMPT, None, sp, None, 0.0, None,
                                                         None, None, external_req_id=PARENT))
    while engine.has_unfinished_requests():
        engine.step()
    writer.close()
    return path


def _fault(model) -> None:
    """A trainer-side fault: the final norm scaled, every logit moved."""
    model.model.norm.weight.data.mul_(1.5)


def _by_name(res) -> dict:
    return {s.request: s for s in res.requests}


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_each_logprobs_mode_agrees_like_for_like_at_the_rounding_level(captures, mode):
    res = score_capture(captures[mode])
    assert res.logprobs_mode == mode and res.rounding and res.overall.max_abs <= 1e-4, res.verdict
    assert res.units == ("logit" if mode.endswith("_logits") else "logprob")
    scores = _by_name(res)
    assert scores["quiet"].set_aside == "it asked for no logprobs, so vLLM returned none"
    assert res.overall.tokens == sum(s.compared for s in res.requests) > 0
    if mode.endswith("_logprobs"):
        assert res.overall.clipped_tokens == 0 and "no token would be clipped at C=2" in res.verdict
    if mode.startswith("processed"):
        assert scores["penalised"].set_aside.startswith("repetition_penalty changed the logits before vLLM's "
                                                        "processed logprobs")
        if mode == "processed_logprobs":
            assert scores["top-p"].semantics.startswith("vLLM's are renormalised over the tokens top-p 0.9 keeps")
            assert scores["top-k"].semantics.startswith("vLLM's are renormalised over the tokens top-k 20 keeps")
            assert not scores["tempered"].semantics  # processed logprobs are tempered, as the trainer's
        else:  # a processed logit of a kept token is its z / T: nothing renormalised
            assert all(scores[r].semantics == "vLLM returned logits, not logprobs (compared as logits)"
                       for r in ("top-p", "top-k", "tempered", "greedy"))
    else:
        assert not scores["penalised"].set_aside  # raw logprobs come before every penalty
        assert scores["tempered"].semantics.startswith("vLLM's raw numbers come before temperature 0.7")
    if mode == "processed_logprobs":  # the renormalisation bias: real, named, not counted
        assert scores["top-p"].semantic_gap > 1e-3 and res.as_trainer is not None
        assert res.as_trainer.max_abs >= scores["top-p"].semantic_gap > 100 * res.overall.max_abs
    if mode == "raw_logprobs":
        assert scores["tempered"].semantic_gap > 1e-3 and not scores["greedy"].semantics


def test_the_builtin_engine_returns_each_mode_and_replays_it(captures):
    for mode in LOGPROBS_MODES:
        assert not replay_capture(captures[mode], ReplayOptions()).diverged
    raw, processed = (score_capture(captures[m], TrainerOptions(requests=["top-p"])) for m in
                      ("raw_logprobs", "processed_logprobs"))
    assert raw.worst[0].vllm != processed.worst[0].vllm  # the same token, another quantity


def test_bfloat16_on_both_sides_is_held_to_bfloat16s_rounding(captures):
    """(The builtin engine computes a step as transformers does: here bfloat16 agrees too. vLLM's kernels do not:
    tests/trainer/test_on_vllm.py.)"""
    res = score_capture(captures["bfloat16"])
    assert res.dtype == "bfloat16" and res.tolerance == 5e-2 and res.overall.tokens > 0
    assert res.rounding and res.worst and res.worst[0].batch_requests >= 1, res.verdict


def test_a_float32_trainer_of_bfloat16_rollouts_is_held_to_bfloat16s_rounding(captures):
    """vLLM's numbers were rounded to bfloat16: a float32 trainer cannot agree with them beyond that."""
    res = score_capture(captures["bfloat16"], TrainerOptions(dtype="float32"))
    assert res.dtype == "float32" and res.tolerance == 5e-2 and res.rounding, res.verdict
    assert any("vLLM computed in bfloat16" in n for n in res.notes)


def test_the_command_prints_the_figures_and_refuses_what_it_cannot_score(captures, qwen, capsys, monkeypatch):
    assert main(["trainer", str(captures["processed_logprobs"])]) == 0
    out, err = capsys.readouterr()
    assert "%|" not in err, err  # transformers' loading bar stays off our stderr
    assert out.startswith("the trainer and vLLM agree at the rounding level") and "like for like:" in out
    assert "as a trainer sees:" in out and "semantics: top-p: vLLM's are renormalised" in out
    assert "set aside: quiet: it asked for no logprobs" in out
    assert main(["trainer", str(captures["raw_logprobs"]), "--json", "--request", "greedy"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["request"] for r in res["requests"]] == ["greedy"] and res["overall"]["tokens"] == 8
    assert main(["trainer", str(captures["raw_logprobs"]), "--model", str(qwen / "missing")]) == 2
    assert f"--model {qwen / 'missing'}: not a checkpoint here" in capsys.readouterr().err  # the user's checkpoint
    assert main(["trainer", str(captures["raw_logprobs"]), "--against", "megatron"]) == 2
    assert "--against megatron: expected one of transformers, builtin" in capsys.readouterr().err
    assert main(["trainer", str(captures["raw_logprobs"]), "--against", "builtin"]) == 2  # (implies --bisect)
    assert "the replay side is the builtin runner already" in capsys.readouterr().err  # a builtin capture
    # --device: the trainer's forward where the trainer runs it. Only the CPU is here: on it the figures are the
    # default run's; a CUDA device is refused in one line before anything loads (bench/gpu_check runs it on one)
    assert main(["trainer", str(captures["raw_logprobs"]), "--json", "--request", "greedy", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["overall"] == res["overall"]
    if not torch.cuda.is_available():
        assert main(["trainer", str(captures["raw_logprobs"]), "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("replay: --device cuda: no CUDA device here"), err
    if importlib.util.find_spec("flash_attn") is None:  # (the trainer's attention on a GPU: its kernels are not here)
        assert main(["trainer", str(captures["raw_logprobs"]), "--attn", "flash_attention_2"]) == 125
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--attn flash_attention_2: FlashAttention2" in err[0], err
    monkeypatch.setitem(sys.modules, "transformers", None)  # as where it is not installed
    assert main(["trainer", str(captures["raw_logprobs"])]) == 125
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'vllm-replay[trainer]'" in err[0], err


def test_packed_micro_batches_score_as_padded_ones_do(captures):
    """One row per micro-batch, position ids restarting, a block-diagonal causal mask: the same figures within
    float32's rounding as right padding."""
    padded, packed = (score_capture(captures["raw_logprobs"], TrainerOptions(micro_batch=3, pack=p))
                      for p in (False, True))
    assert packed.pack and packed.rounding and packed.overall.tokens == padded.overall.tokens, packed.verdict
    assert abs(packed.overall.mean_abs - padded.overall.mean_abs) < 1e-6


@needs_chromium
def test_the_report_shows_the_figures_a_histogram_and_delta_by_position(captures, tmp_path, capsys):
    capture = captures["processed_logprobs"]
    assert main(["trainer", str(capture), "--json"]) == 0
    doc = capsys.readouterr().out
    (tmp_path / "trainer.json").write_text(doc)
    assert main(["report", str(capture), "--trainer", str(tmp_path / "trainer.json"), "-o",
                 str(tmp_path / "t.html")]) == 0
    dom, text, console = load(tmp_path / "t.html", tmp_path / "profile")
    assert dom.status() == "ready" and dom.by_id("trainer")["data-rounding"] == "1"
    hist = json.loads(doc)["histogram"]
    assert sum(b["tokens"] for b in hist) == json.loads(doc)["overall"]["tokens"]
    assert len(dom.inside("tr", "trainer-histogram")) == len(hist)
    assert len(dom.inside("tr", "trainer-positions")) == len(json.loads(doc)["by_position"])
    assert "renormalised over the tokens top-p 0.9 keeps" in dom.text["trainer"]
    assert not [c for c in console if "Error" in c], console
    assert main(["report", str(capture), "--trainer", str(capture)]) == 2  # a capture, not a trainer report
    assert "cannot read a trainer report" in capsys.readouterr().err


def test_the_report_refuses_a_trainer_report_of_another_capture(captures, tmp_path, capsys):
    """As --bisect and --explain do: the figures of one run must not sit on the page of another."""
    assert main(["trainer", str(captures["raw_logprobs"]), "--json", "--worst", "1"]) == 0
    (tmp_path / "trainer.json").write_text(capsys.readouterr().out)
    args = ["--trainer", str(tmp_path / "trainer.json"), "-o", str(tmp_path / "t.html")]
    assert main(["report", str(captures["bfloat16"]), *args]) == 2
    assert "a trainer report of " in capsys.readouterr().err
    assert main(["report", str(captures["raw_logprobs"]), *args]) == 0


def test_the_verdict_and_the_bisect_take_the_worst_token_whatever_worst_prints(captures):
    """--worst 0 prints no worst token; the verdict still names where the two part most, and --bisect still bisects
    there."""
    shown, silent = (score_capture(captures["raw_logprobs"], TrainerOptions(worst=n), hook=_fault) for n in (1, 0))
    assert not silent.rounding and silent.worst == [] and silent.verdict == shown.verdict
    top = shown.worst[0]
    assert f"at request {top.request}, position {top.position}" in silent.verdict
    res = score_capture(captures["raw_logprobs"], TrainerOptions(worst=0, bisect=True))
    assert res.worst == [] and res.layers is not None and res.layers.modules
    best = score_capture(captures["raw_logprobs"], TrainerOptions(worst=1)).worst[0]
    assert (res.layers.request, res.layers.position) == (best.request, best.position)


def test_the_worst_token_table_fits_vllms_request_ids(fanned):
    res = score_capture(fanned, TrainerOptions(worst=4))
    assert res.worst and {w.request for w in res.worst} <= {f"{PARENT}#0", f"{PARENT}#1"}
    lines = render_trainer(res).splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.lstrip().startswith("request")):][:1 + len(res.worst)]
    assert len({len(line) for line in table}) == 1, table  # every column in line with the header's


def test_sequences_sampled_alike_share_one_semantics_line(fanned):
    """An RL batch samples every sequence alike: one line says how vLLM's numbers differ in meaning, not one each."""
    res = score_capture(fanned)
    assert [bool(s.semantics) for s in res.requests] == [True, True], res.requests
    [line] = [x for x in render_trainer(res).splitlines() if "semantics:" in x]
    assert line.startswith(f"  semantics: {PARENT}#0, {PARENT}#1: vLLM's raw numbers come before temperature 0.7"), line


def test_the_command_refuses_requests_it_cannot_compare_and_a_dump_without_a_bisect(captures, fanned, tmp_path,
                                                                                    capsys):
    assert main(["trainer", str(fanned), "--request", PARENT]) == 2  # the parent of an n=2 request: name its sequences
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"no request {PARENT} generated a token (its sequences: {PARENT}#0, {PARENT}#1)" in err[0]
    assert main(["trainer", str(fanned), "--token", f"{PARENT}:0"]) == 2  # the same for the token a bisect takes
    assert f"(its sequences: {PARENT}#0, {PARENT}#1)" in capsys.readouterr().err
    assert main(["trainer", str(captures["raw_logprobs"]), "--request", "quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--request quiet: recorded no logprobs" in err[0] and "record it with logprobs" in err[0]
    assert main(["trainer", str(captures["raw_logprobs"]), "--dump", str(tmp_path / "dump")]) == 2
    assert "--dump needs --bisect" in capsys.readouterr().err and not (tmp_path / "dump").exists()


def test_a_capture_cut_short_is_scored_on_what_it_holds_and_exits_3(qwen, tmp_path, capsys):
    whole, cut = tmp_path / "whole.capture", tmp_path / "cut.capture"
    cfg = EngineConfig(model=str(qwen), scheduler=SchedulerConfig(block_size=16, num_gpu_blocks=64),
                       runner=RunnerConfig(num_threads=1))
    record_builtin(RecordOptions(cfg, _workload(), whole, flush_interval=0.001))  # a chunk a step or so
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size * 3 // 4])
    assert main(["trainer", str(cut)]) == 3
    out = capsys.readouterr().out
    assert out.startswith("the trainer and vLLM agree") and "capture damaged (" in out, out


def test_a_module_whose_shape_differs_from_the_trainers_is_named_not_counted_silently(captures, monkeypatch):
    """A module put together otherwise than the trainer's (the KV heads of a TP layout gathered wrongly, say) cannot
    be compared: the bisect names it."""
    import replay.trainer.layers as layers

    real = layers._trainer_modules

    def one_column_more(model, seq, rows):
        out, sources = real(model, seq, rows)
        t = out["layers.0.mlp.down_proj"]
        out["layers.0.mlp.down_proj"] = torch.cat([t, t[:, :1]], dim=1)
        return out, sources

    monkeypatch.setattr(layers, "_trainer_modules", one_column_more)
    for token in (("greedy", 0), ("greedy", 3)):  # its prefill (the engine's logits: its last row alone), a decode
        res = score_capture(captures["raw_logprobs"], TrainerOptions(worst=1, bisect=True, token=token))
        assert not any(m.module.endswith("layers.0.mlp.down_proj") for m in res.layers.modules)
        assert any(m.module.endswith("lm_head") for m in res.layers.modules)
        assert "not compared, their shape differs from the trainer's: layers.0.mlp.down_proj" in res.layers.notes
