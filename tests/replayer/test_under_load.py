"""The reference runner gives the same bits under CPU load: record -> replay cycles while busy processes compete for
both cores (a Python spin loop and a two-thread torch GEMM loop, started by the test and bounded in time), at
the default thread count and at one thread. `git bisect run replay check` relies on it on a shared CI box."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic
from replay.replayer import replay_capture

LIMIT_S = 300  # the load stops by itself after this, whatever happens to the test


def _spin(stop, deadline):
    x = 0
    while not stop.is_set() and time.time() < deadline:
        for _ in range(10_000):
            x += 1


def _gemm(stop, deadline):
    import torch

    torch.set_num_threads(2)
    a = torch.randn(384, 384)
    while not stop.is_set() and time.time() < deadline:
        a = torch.tanh(a @ a)


@pytest.fixture
def loaded_cpu():
    """A spinning process and a two-thread GEMM process on a 2-core machine, for the duration of the test."""
    ctx = mp.get_context("spawn")
    stop, deadline = ctx.Event(), time.time() + LIMIT_S
    procs = [ctx.Process(target=f, args=(stop, deadline), daemon=True) for f in (_spin, _gemm)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # the GEMM processes are importing torch: let the load build up
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# The shape of a capture recorded on a loaded machine that diverged on every quiet replay: 8 requests arriving together,
# so step 0 is a 256-token prefill of 6 requests split over both threads' GEMM rows.
WORKLOAD = dict(num_requests=8, prompt_len=(20, 60), output_len=(8, 16), arrival_rate=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("threads,cycles", [(None, 20), (1, 4)], ids=["default-threads", "one-thread"])
def test_record_and_replay_under_load_are_bitwise(tmp_path, loaded_cpu, threads, cycles):
    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=256), runner=RunnerConfig(num_threads=threads))
    diverged = []
    for seed in range(cycles):
        path = tmp_path / f"c{seed}.capture"
        record_builtin(RecordOptions(cfg, synthetic(SyntheticWorkload(seed=seed, **WORKLOAD), 512), path))
        rep = replay_capture(path)  # under the same load: a nondeterministic kernel would show on either side
        assert rep.steps_compared > 0
        if rep.diverged:
            diverged.append((seed, rep.first_divergence))
    print(f"{cycles} record -> replay cycles under load, threads={threads or 'default'}: {len(diverged)} diverged")
    assert diverged == []
