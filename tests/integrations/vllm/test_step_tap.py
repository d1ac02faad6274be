"""`StepTap`: its settings from the environment, and the snapshot a ring seals when vLLM finishes a request with an
error. Its steps, arrivals, crashes and a writer that fails mid-run are tested on real vLLM engines in test_plugin.py,
test_server.py and tests/record/test_vllm.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from replay.capture import CaptureReader
from replay.inspect import capture_info
from replay.integrations.vllm import step_tap


@pytest.mark.parametrize(("value", "level"), [("17", 17), ("0", 1), ("-4", 1), ("99", 22)])
def test_the_zstd_level_is_held_to_what_zstd_takes(monkeypatch, value, level):
    monkeypatch.setenv(step_tap.LEVEL_ENV, value)
    assert step_tap._int_env(step_tap.LEVEL_ENV, step_tap.DEFAULT_LEVEL) == level


def test_a_level_that_is_no_integer_is_logged_and_the_default_used(monkeypatch, caplog):
    monkeypatch.setenv(step_tap.LEVEL_ENV, "high")
    # on the tap's own logger: once vLLM has configured logging in this process, "vllm" no longer propagates to root
    monkeypatch.setattr(step_tap.log, "handlers", [caplog.handler])
    with caplog.at_level(logging.WARNING, logger="vllm.replay"):
        assert step_tap._int_env(step_tap.LEVEL_ENV, step_tap.DEFAULT_LEVEL) == step_tap.DEFAULT_LEVEL
    assert "REPLAY_ZSTD_LEVEL='high' is not an integer; using 3" in caplog.text


def test_importing_the_tap_imports_nothing_of_the_capture_or_of_vllm():
    """The plugin imports it in every vLLM process, recording or not."""
    code = ("import sys, replay.integrations.vllm.step_tap; "
            "print(sorted(m for m in sys.modules if m.startswith(('vllm', 'replay.capture', 'msgspec', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


ERRORS = textwrap.dedent("""
    import os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["REPLAY_CAPTURE_RING"] = "1MB"

    def main():
        from vllm import LLM, SamplingParams
        from vllm.v1.request import RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager

        accept = StructuredOutputManager.accept_tokens

        def reject(self, request, new_token_ids):  # a stand-in for a grammar that rejects a sampled token (a bug)
            if request.request_id.startswith("2-") and request.num_output_tokens >= 4:
                return False
            return accept(self, request, new_token_ids)

        StructuredOutputManager.accept_tokens = reject
        try:
            llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                      enforce_eager=True, seed=0, max_num_seqs=8)
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 3 for j in range(5 + 3 * i)]}
                       for i in range(4)]
            out = llm.generate(prompts, params, use_tqdm=False)
            print("finished", [o.outputs[0].finish_reason for o in out], flush=True)
            # vLLM finishes requests with an error through finish_requests too (a grammar that does not compile, a
            # KV transfer that failed): called here as its scheduler calls it, between two steps
            engine = llm.llm_engine
            engine.add_request("late", {"prompt_token_ids": [5, 6, 7, 8]}, params)
            engine.step()
            scheduler = engine.engine_core.engine_core.scheduler
            scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ERROR)
            engine.step()  # (the front end is never told: it would wait for that request forever)
        finally:
            StructuredOutputManager.accept_tokens = accept  # (run in a test's process: later engines grammar-check)
        return llm

    if __name__ == "__main__":
        main()
""")


def test_every_request_vllm_finishes_with_an_error_seals_one_snapshot_holding_its_step(tmp_path):
    """A ring seals a snapshot when vLLM finishes a request with an error: through finish_requests, and where vLLM
    sets the status itself (a grammar that rejects a sampled token, planted here), which earlier went unseen. The
    snapshot holds the step where it happened. The script runs in this process (its engine core too), recorded as
    a serving process is."""
    pytest.importorskip("vllm")
    from testbed.checkpoints import tiny_llama
    from testbed.vllm_record import run_here

    script, ring = tmp_path / "errors.py", tmp_path / "ring"
    script.write_text(ERRORS)
    out = run_here(script, [str(tiny_llama(tmp_path / "tiny-llama"))], dict(os.environ, REPLAY_CAPTURE=str(ring)))
    assert "finished ['length', 'length', 'error', 'length']" in out
    snapshots = {capture_info(p).snapshot["trigger"]: p for p in (ring / "snapshots").glob("*.capture")}
    assert sorted(t.split()[1].split("-")[0] for t in snapshots) == ["2", "late"], list(snapshots)
    [rejected] = [p for t, p in snapshots.items() if t.startswith("request 2-")]
    with CaptureReader(rejected) as r:
        outputs = [s.model_runner_output for s in r.steps()]
    sampled = [[t for rid, t in zip(o.req_ids, o.sampled_token_ids) if rid.startswith("2-")] for o in outputs]
    # its four tokens, the last of them the one the grammar rejected, in the snapshot's last step
    assert sum(len(t) for t in sampled) == 4 and sampled[-1], sampled
