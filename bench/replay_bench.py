"""Replay benchmark: replay wall time vs the recording's own engine time, and the diff's cost per step.

Method: record the default workload on `tiny` (`replay record` with no arguments: 16 requests, mixed sampling,
float32, one thread) REPEATS times, then replay each capture in forced mode without and with the diff. Reported
side by side, medians over the repeats (the development machine is a shared, noisy 2-core box):

  record engine s    the record run's engine time: the sum of schedule + execute + update over its steps, from the
                     capture's own step timings (what the engine spent, without the tap's encode)
  record wall s      the whole record run (engine + tap + writer close)
  replay s           `replay_capture(..., diff=False)`: runner time over all steps (capture reading excluded)
  replay+diff s      the same with the diff (its wall time, reading and diffing included)
  diff us/step       (replay+diff wall - replay wall) / steps

Goal: replay <= 1.1x the record run's engine time.

    .venv/bin/python -m bench.replay_bench [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from replay.capture import CaptureReader, Step
from replay.engine.config import EngineConfig, RunnerConfig
from replay.provenance import set_torch_threads
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic
from replay.replayer import ReplayOptions, replay_capture


def engine_seconds(path: Path) -> tuple[float, int]:
    """Sum of the recorded schedule + execute + update time, and the number of steps."""
    total, n = 0, 0
    with CaptureReader(path) as r:
        for rec in r.records():
            if isinstance(rec, Step) and rec.timing is not None:
                t = rec.timing
                total += t.schedule_ns + t.execute_ns + t.update_ns
                n += 1
    return total / 1e9, n


def one_round(tmp: Path, i: int, workload: SyntheticWorkload) -> dict:
    """Record once, replay without and with diff."""
    path = tmp / f"r{i}.capture"
    t = time.perf_counter()
    record_builtin(RecordOptions(EngineConfig(runner=RunnerConfig(num_threads=1)), synthetic(workload, 512), path,
                         overwrite=True))
    record_wall = time.perf_counter() - t
    engine_s, steps = engine_seconds(path)
    t = time.perf_counter()
    plain = replay_capture(path, ReplayOptions(diff=False))
    replay_wall = time.perf_counter() - t
    t = time.perf_counter()
    diffed = replay_capture(path, ReplayOptions())
    diff_wall = time.perf_counter() - t
    assert not diffed.diverged, "self-replay must match"
    return {"steps": steps, "record_engine_s": engine_s, "record_wall_s": record_wall,
            "replay_runner_s": plain.replay_s, "replay_wall_s": replay_wall, "replay_diff_wall_s": diff_wall,
            "recorded_execute_s": plain.record_execute_s}


def main() -> None:
    """Run the rounds, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    set_torch_threads(1)
    rows = {}
    for name, wl in [("default workload (16 requests)", SyntheticWorkload()),
                     ("64 requests, 32-64 output tokens", SyntheticWorkload(num_requests=64, output_len=(32, 64)))]:
        with tempfile.TemporaryDirectory() as d:
            rounds = [one_round(Path(d), i, wl) for i in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        med["replay_over_engine"] = med["replay_runner_s"] / med["record_engine_s"]
        med["replay_wall_over_engine"] = med["replay_wall_s"] / med["record_engine_s"]
        med["diff_us_per_step"] = (med["replay_diff_wall_s"] - med["replay_wall_s"]) / med["steps"] * 1e6
        rows[name] = med
    targets = [{"target": f"replay <= 1.1x the record run's engine time ({name})", "measured": m["replay_over_engine"],
                "pass": m["replay_over_engine"] <= 1.1} for name, m in rows.items()]
    if args.json:
        print(json.dumps({"workloads": rows, "targets": targets}, indent=2))
        return
    print(f"machine: python {platform.python_version()}, torch {torch.__version__}, 1 thread; medians of "
          f"{args.repeats} rounds on a shared, noisy 2-core box")
    fmt = "{:<36} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12} {:>10}"
    print(fmt.format("workload", "steps", "rec engine", "rec wall", "replay", "replay wall", "replay+diff",
                     "diff/step"))
    for name, m in rows.items():
        print(fmt.format(name, int(m["steps"]), f"{m['record_engine_s']:.3f}s", f"{m['record_wall_s']:.3f}s",
                         f"{m['replay_runner_s']:.3f}s", f"{m['replay_wall_s']:.3f}s",
                         f"{m['replay_diff_wall_s']:.3f}s",
                         f"{m['diff_us_per_step']:.0f}us"))
    print()
    for name, m in rows.items():
        ok = m["replay_over_engine"] <= 1.1
        print(f"{'PASS' if ok else 'FAIL'}  replay <= 1.1x record engine time ({name}): {m['replay_over_engine']:.2f}x "
              f"(whole replay call incl. model load and capture reading: {m['replay_wall_over_engine']:.2f}x)")


if __name__ == "__main__":
    main()
