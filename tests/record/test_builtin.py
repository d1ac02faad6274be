"""replay record: real engine runs into real captures, from synthetic workloads, JSONL files and checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from replay.capture import CaptureReader, RequestAdded, Step
from replay.cli import app
from replay.contracts import SamplingParams
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.engine.engine import LLMEngine
from replay.inspect import capture_info
from replay.provenance import set_torch_threads
from replay.record import (
    RecordOptions,
    SyntheticWorkload,
    WorkloadRequest,
    record_builtin,
    run_engine,
    synthetic,
)

SMALL_POOL = SchedulerConfig(block_size=4, num_gpu_blocks=24, max_num_seqs=8, max_num_batched_tokens=16)


def outputs_by_request(path) -> dict[str, list[int]]:
    ext, out = {}, {}
    with CaptureReader(path) as r:
        for rec in r.records():
            if isinstance(rec, RequestAdded):
                ext[rec.request.request_id] = rec.request.external_req_id
            elif isinstance(rec, Step):
                for rid, toks in zip(rec.model_runner_output.req_ids, rec.model_runner_output.sampled_token_ids):
                    out.setdefault(ext[rid], []).extend(toks)
    return out


def test_a_run_with_every_feature_records_a_clean_capture(tmp_path):
    wl = SyntheticWorkload(num_requests=12, prompt_len=(6, 30), output_len=(4, 16), arrival_rate=2,
                           shared_prefix_fraction=0.5, sampling="mixed", seed=3, defaults={})
    reqs = synthetic(wl, 512)
    reqs[0].params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=3, logprobs=2)
    reqs[1].params = SamplingParams(temperature=0.8, top_k=20, seed=77, max_tokens=8, logprobs=2)
    reqs[2].params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)  # unseeded: the engine draws a seed
    res = record_builtin(RecordOptions(EngineConfig(scheduler=SMALL_POOL, runner=RunnerConfig(num_threads=1)), reqs,
                               tmp_path / "all.capture"))
    info = capture_info(res.path)
    assert info.complete and not info.damage and info.num_steps == res.steps
    assert info.num_generated_tokens == res.generated_tokens == sum(r.params.max_tokens for r in reqs)
    seen = dict(preempted=0, resumed=0, prefix_hit=0, partial=0, drawn=0, prompt_lp=0, seeded=0)
    with CaptureReader(res.path) as r:
        for s in r.records():
            if not isinstance(s, Step):
                continue
            so, mro = s.scheduler_output, s.model_runner_output
            seen["preempted"] += len(so.preempted_req_ids or ())
            seen["resumed"] += len(so.scheduled_cached_reqs.resumed_req_ids)
            seen["prefix_hit"] += sum(n.num_computed_tokens > 0 for n in so.scheduled_new_reqs)
            seen["seeded"] += sum(n.sampling_params.seed is not None for n in so.scheduled_new_reqs)
            seen["partial"] += sum(t == [] for t in mro.sampled_token_ids)
            seen["drawn"] += len(s.drawn_seeds)
            seen["prompt_lp"] += sum(v is not None for v in mro.prompt_logprobs_dict.values())
    assert all(v > 0 for v in seen.values()), str(seen)


def test_preemption_and_prefix_caching_do_not_change_greedy_outputs(tmp_path):
    wl = SyntheticWorkload(num_requests=10, prompt_len=(8, 30), output_len=(6, 12), shared_prefix_fraction=0.5,
                           sampling="greedy", seed=8)
    tight = record_builtin(RecordOptions(EngineConfig(scheduler=SMALL_POOL, runner=RunnerConfig(num_threads=1)),
                                 synthetic(wl, 512), tmp_path / "tight.capture"))
    roomy_pool = SchedulerConfig(num_gpu_blocks=256, enable_prefix_caching=False, max_num_batched_tokens=1024)
    roomy = record_builtin(RecordOptions(EngineConfig(scheduler=roomy_pool, runner=RunnerConfig(num_threads=1)),
                                         synthetic(wl, 512), tmp_path / "roomy.capture"))
    assert outputs_by_request(tight.path) == outputs_by_request(roomy.path)


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_crowd():
    set_torch_threads(1)
    seeded = WorkloadRequest(SamplingParams(temperature=1.0, seed=1234, max_tokens=12), None, list(range(10, 30)), "s")

    def tokens(extra: int) -> list[int]:
        engine = LLMEngine(EngineConfig(runner=RunnerConfig(num_threads=1)))
        got = []
        engine.listeners.append(type("L", (), {
            "on_request_added": lambda *a: None, "on_request_aborted": lambda *a: None,
            "on_step": lambda self, i, so, mro,
            **k: got.extend(mro.sampled(next(r for r in mro.req_ids if r.startswith("s-")))
                                                                  if any(r.startswith("s-") for r in mro.req_ids)
                                                                  else []),
        })())
        crowd = [WorkloadRequest(SamplingParams(temperature=0.9, max_tokens=10), None, list(range(40 + i, 60 + i)),
                                 f"n{i}") for i in range(extra)]
        run_engine(engine, crowd + [seeded])
        return got

    assert tokens(0) == tokens(5)


def test_record_from_jsonl_with_text_prompts(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "Hello, world", "max_tokens": 5, "request_id": "greeting"},
        {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0.7, "seed": 9, "arrival_step": 2},
    ]) + "\n")
    res = CliRunner().invoke(app, ["record", "--prompts", str(prompts), "--out", str(tmp_path / "j.capture"), "--json"])
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["requests"] == 2 and data["generated_tokens"] == 8
    with CaptureReader(tmp_path / "j.capture") as r:
        added = [x for x in r.records() if isinstance(x, RequestAdded)]
    assert added[0].request.external_req_id == "greeting"
    assert added[0].request.prompt_token_ids[0] == 1  # the byte tokenizer's bos
    assert added[1].step >= 2


def test_a_request_asking_logprob_token_ids_records_vllms_layout_and_replays_it_bitwise(tmp_path):
    """Every row of a step where one request asks `logprob_token_ids` has its columns: the sampled token, then the
    asked ids (padded with token 0 at -inf), even a row that asked for the top 2 (vLLM prefers the ids)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0, "logprob_token_ids": [9, 10, 11],
         "request_id": "scored"},
        {"prompt_token_ids": [12, 13, 14], "max_tokens": 4, "temperature": 0.0, "logprobs": 2, "request_id": "top2"},
        {"prompt_token_ids": [20, 21], "max_tokens": 4, "temperature": 0.7, "seed": 3, "request_id": "plain"},
    ]) + "\n")
    cap = tmp_path / "ids.capture"
    res = CliRunner().invoke(app, ["record", "--prompts", str(prompts), "--out", str(cap), "--threads", "1"])
    assert res.exit_code == 0, res.stderr
    ext, rows = {}, {}
    with CaptureReader(cap) as r:
        for rec in r.records():
            if isinstance(rec, RequestAdded):
                ext[rec.request.request_id] = rec.request.external_req_id
            elif isinstance(rec, Step) and rec.model_runner_output is not None:
                lp = rec.model_runner_output.logprobs
                for i, rid in enumerate(rec.model_runner_output.req_ids):
                    rows.setdefault(ext[rid], []).append((lp.logprob_token_ids.to_numpy()[i],
                                                          lp.logprobs.to_numpy()[i]))
    assert sorted(rows) == ["plain", "scored", "top2"]
    for name, got in rows.items():
        for ids, values in got:
            assert ids[1:].tolist() == ([9, 10, 11] if name == "scored" else [0, 0, 0])
            assert np.isfinite(values).all() if name == "scored" else np.isneginf(values[1:]).all()
    res = CliRunner().invoke(app, ["run", str(cap), "--diff"])
    assert res.exit_code == 0, res.stdout + res.stderr


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x", "prompt_token_ids": [1]}', "exactly one of"),
    ('{"prompt": "x", "temprature": 0.5}', "unknown field(s) temprature"),
    ('{"prompt": "x", "max_tokens": "many"}', "invalid sampling field"),
    ('not json', "not JSON"),
    ('{"prompt_token_ids": [1, 99999]}', "outside the model's vocabulary"),
    ('{"prompt": "x", "logprob_token_ids": [7, 99999]}', "logprob_token_ids [99999] outside the model's vocabulary"),
])
def test_bad_prompts_file_is_one_line_exit_2(tmp_path, line, message):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(line + "\n")
    res = CliRunner().invoke(app, ["record", "--prompts", str(prompts), "--out", str(tmp_path / "x.capture")])
    assert res.exit_code == 2 and message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_record_on_a_local_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=300, eos_token_id=2)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    res = CliRunner().invoke(app, ["record", "--model", str(tmp_path / "ckpt"), "--num-requests", "4",
                                   "--out", str(tmp_path / "q.capture"), "--threads", "1"])
    assert res.exit_code == 0, res.stderr
    info = capture_info(tmp_path / "q.capture")
    assert info.header.model.architecture == "Qwen3ForCausalLM" and info.num_generated_tokens > 0
    assert len(info.header.model.fingerprint) == 64


def test_record_refuses_an_existing_capture_and_a_missing_model(tmp_path):
    out = tmp_path / "x.capture"
    runner = CliRunner()
    assert runner.invoke(app, ["record", "--num-requests", "1", "--out", str(out)]).exit_code == 0
    res = runner.invoke(app, ["record", "--num-requests", "1", "--out", str(out)])
    assert res.exit_code == 2 and "already exists" in res.stderr
    res = runner.invoke(app, ["record", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "y.capture")])
    assert res.exit_code == 2 and "nope" in res.stderr and "Traceback" not in res.stderr


def test_record_from_python_refuses_two_requests_under_one_id(tmp_path):
    """The JSONL loader refused them; the library took them, and a bisect then took two requests for one."""
    from replay.errors import UsageError
    from replay.record import EngineOptions, WorkloadRequest, record

    sp = SamplingParams(max_tokens=2, temperature=0.0)
    reqs = [WorkloadRequest(sp, None, [5, 6, 7], "x"), WorkloadRequest(sp, None, [8, 9], "x")]
    with pytest.raises(UsageError, match=r"request_id values must be unique \(x given more than once\)"):
        record(EngineOptions(model="tiny", threads=1), reqs, tmp_path / "twice.capture")
    assert not (tmp_path / "twice.capture").exists()
