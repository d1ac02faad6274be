"""Real captures for the report tests, recorded once per session with the builtin engine: a small KV pool (so
requests are preempted), a shared prompt prefix (prefix-cache hits), arrivals over several steps; a second run of
the same workload with another token budget (batch variance: a real two-run divergence); and a synthetic capture
longer and wider than the plots (binned columns and rows)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic
from replay.record.synth import SynthShape, record_synth
from tests.report.helpers import cli

WORKLOAD = SyntheticWorkload(num_requests=8, prompt_len=(12, 40), output_len=(6, 12), arrival_rate=1.0,
                             sampling="greedy", num_logprobs=3, seed=7)
BIG = SynthShape(steps=1300, running=8, prompt_len=(4, 24), output_len=(2, 12), num_logprobs=2, vocab_size=500,
                 block_size=4, max_num_batched_tokens=96, seed=3)


def record(path: Path, budget: int = 48, blocks: int = 28) -> Path:
    """The workload on `tiny`, one thread, `blocks` KV blocks of 4 tokens (few enough to preempt)."""
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=blocks, max_num_seqs=6,
                                                 max_num_batched_tokens=budget),
                       runner=RunnerConfig(num_threads=1))
    return Path(record_builtin(RecordOptions(cfg, synthetic(WORKLOAD, 512), path, overwrite=True)).path)


@pytest.fixture(scope="session")
def recorded(tmp_path_factory) -> Path:
    """The workload, recorded."""
    return record(tmp_path_factory.mktemp("report") / "run.capture")


@pytest.fixture(scope="session")
def recorded_other(tmp_path_factory) -> Path:
    """The same workload under another token budget (and a roomier pool): other batches, other float32 bits."""
    return record(tmp_path_factory.mktemp("report") / "other.capture", budget=31, blocks=64)


@pytest.fixture(scope="session")
def big_synthetic(tmp_path_factory) -> Path:
    """1,300 steps of 8 running requests with churn: more steps than columns, more requests than rows."""
    return record_synth(tmp_path_factory.mktemp("report") / "big.capture", BIG)


@pytest.fixture(scope="session")
def big_synthetic_other(tmp_path_factory) -> Path:
    """The same shape from another seed: the same request ids, other tokens (every request flips at once)."""
    return record_synth(tmp_path_factory.mktemp("report") / "big-other.capture", dataclasses.replace(BIG, seed=4))


@dataclass
class Made:
    """A report written by `replay report`, and what the terminal said about the same comparison."""

    page: Path
    code: int  # of `replay report`
    stdout: str  # of `replay report`
    terminal: str = ""  # `replay run --diff` / `replay diff` text
    json: dict | None = None  # ... with --json


@pytest.fixture(scope="session")
def bf16(recorded, tmp_path_factory) -> Made:
    """`replay report CAPTURE --diff --set dtype=bfloat16`: a real divergence."""
    page = tmp_path_factory.mktemp("pages") / "bf16.html"
    code, stdout, _ = cli("report", str(recorded), "--diff", "--set", "dtype=bfloat16", "-o", str(page))
    terminal = cli("run", str(recorded), "--diff", "--set", "dtype=bfloat16")[1]
    as_json = json.loads(cli("run", str(recorded), "--diff", "--set", "dtype=bfloat16", "--json")[1])
    return Made(page, code, stdout, terminal, as_json)


@pytest.fixture(scope="session")
def two_runs(recorded, recorded_other, tmp_path_factory) -> Made:
    """`replay report A B`: two recordings of one workload under other token budgets."""
    page = tmp_path_factory.mktemp("pages") / "ab.html"
    code, stdout, _ = cli("report", str(recorded), str(recorded_other), "-o", str(page))
    terminal = cli("diff", str(recorded), str(recorded_other))[1]
    as_json = json.loads(cli("diff", str(recorded), str(recorded_other), "--json")[1])
    return Made(page, code, stdout, terminal, as_json)


@pytest.fixture(scope="session")
def run_only(recorded, tmp_path_factory) -> Made:
    """`replay report CAPTURE`: the run, no comparison."""
    page = tmp_path_factory.mktemp("pages") / "run.html"
    code, stdout, _ = cli("report", str(recorded), "-o", str(page))
    return Made(page, code, stdout)


@pytest.fixture(scope="session")
def binned(big_synthetic, big_synthetic_other, tmp_path_factory) -> Made:
    """`replay report A B` of two long, wide synthetic runs: binned columns and rows."""
    page = tmp_path_factory.mktemp("pages") / "big.html"
    code, stdout, _ = cli("report", str(big_synthetic), str(big_synthetic_other), "-o", str(page))
    return Made(page, code, stdout)
