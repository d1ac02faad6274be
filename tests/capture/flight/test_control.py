"""`replay snapshot` against a running recorder (the builtin engine recording into a ring, `record --ring`), from
another process, and on the segments a stopped one left; the snapshots replay, in-window requests bitwise.

A crash inside ring mode leaves its snapshot, which reproduces the crash (the fault planted in the builtin runner,
as in tests/replayer/test_crash.py; the real vLLM crash is in tests/integrations/vllm/test_ring.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from replay.capture import CaptureReader
from replay.capture.flight.control import request_snapshot
from replay.diff import Tolerance
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.engine.model_runner import ModelRunner
from replay.errors import CaptureError, UsageError
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic
from replay.replayer import ReplayOptions, replay_capture

ROOT = Path(__file__).resolve().parents[3]
CFG = EngineConfig(scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=96, max_num_seqs=8,
                                             max_num_batched_tokens=64),
                   runner=RunnerConfig(num_threads=1))


def _workload(n: int):
    return synthetic(SyntheticWorkload(num_requests=n, arrival_rate=1.0, output_len=(8, 40),
                                       defaults={"logprobs": 3}), 512)


def test_a_snapshot_from_another_shell_while_the_engine_records_replays_bitwise(tmp_path):
    ring = tmp_path / "ring"
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("res", record_builtin(RecordOptions(
        CFG, _workload(900), ring, ring=160 << 10, flush_interval=0.05))))
    t.start()
    try:
        deadline = time.time() + 60
        while not list(ring.glob("segment-000003.capture")) and time.time() < deadline:
            time.sleep(0.05)
        out = subprocess.run([sys.executable, str(ROOT / "cli.py"), "snapshot", str(ring), "--after", "20"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    finally:
        t.join(120)
    assert out.returncode == 0, out.stderr
    assert "sealed by the running recorder" in out.stdout
    snap = Path(out.stdout.strip().splitlines()[-1])  # its path, last
    with CaptureReader(snap) as r:
        first, last = r.step_span()
    assert first > 0 and done["res"].steps > last
    rep = replay_capture(snap, ReplayOptions(tolerance=Tolerance()))
    assert not rep.diverged and rep.keyframe == first and rep.rebuilt
    # held to the bits, rebuilt ones too: only those may differ, and by less than the rebuild tolerance
    import replay.replayer.prime as prime

    saved = dict(prime.REBUILD_ATOL)
    prime.REBUILD_ATOL.update({k: 0.0 for k in saved})
    try:
        exact = replay_capture(snap, ReplayOptions(tolerance=Tolerance()))
    finally:
        prime.REBUILD_ATOL.update(saved)
    assert all(d.request_id in exact.rebuilt and d.kind == "logprobs" for d in exact.divergences)


def test_without_a_running_recorder_the_segments_on_disk_are_sealed(tmp_path):
    ring = tmp_path / "ring"
    record_builtin(RecordOptions(CFG, _workload(300), ring, ring=128 << 10, flush_interval=0.05))
    res = request_snapshot(ring)
    assert not res.live and Path(res.path).parent == ring / "snapshots"
    assert not replay_capture(res.path, ReplayOptions()).diverged
    with pytest.raises(UsageError, match="no recorder is running"):
        request_snapshot(ring, after=5)
    with pytest.raises(UsageError, match="not a ring"):
        request_snapshot(tmp_path)


def test_a_crash_in_ring_mode_leaves_a_snapshot_that_reproduces_it(tmp_path, monkeypatch):
    run_step = ModelRunner.run_step
    seen = {"n": 0}

    def failing(self, so, grammar_output=None):
        if so.total_num_scheduled_tokens:
            seen["n"] += 1
            if seen["n"] == 400:
                raise RuntimeError("planted kernel failure")
        return run_step(self, so, grammar_output)

    monkeypatch.setattr(ModelRunner, "run_step", failing)
    ring = tmp_path / "ring"
    with pytest.raises(RuntimeError, match="planted kernel failure"):
        record_builtin(RecordOptions(CFG, _workload(600), ring, ring=128 << 10, flush_interval=0.05))
    [snap] = (ring / "snapshots").glob("*crash*.capture")
    with CaptureReader(snap) as r:
        assert r.index.status.startswith("crashed at step") and r.step_span()[0] > 0
        crashed = r.step(r.step_span()[1]).scheduler_output.num_scheduled_tokens

    def fails_there(self, so, grammar_output=None):  # the same fault, where the recording met it
        if so.num_scheduled_tokens == crashed:
            raise RuntimeError("planted kernel failure")
        return run_step(self, so, grammar_output)

    monkeypatch.setattr(ModelRunner, "run_step", fails_there)
    rep = replay_capture(snap, ReplayOptions())
    assert rep.crash is not None and rep.crash.reproduced and not rep.diverged


def test_a_snapshot_that_cannot_be_sealed_says_why(tmp_path):
    ring = tmp_path / "ring"
    ring.mkdir()
    (ring / "segment-000001.capture").write_bytes(b"not a capture")
    with pytest.raises(CaptureError, match="no readable segment"):
        request_snapshot(ring)
