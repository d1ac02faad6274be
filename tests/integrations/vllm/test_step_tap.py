"""`StepTap`'s settings from the environment. Its steps, arrivals, crashes and a writer that fails mid-run are tested
on real vLLM engines: test_plugin.py, test_server.py, tests/record/test_vllm.py."""

from __future__ import annotations

import logging

import pytest

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
    import subprocess
    import sys

    code = ("import sys, replay.integrations.vllm.step_tap; "
            "print(sorted(m for m in sys.modules if m.startswith(('vllm', 'replay.capture', 'msgspec', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
