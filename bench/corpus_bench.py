"""`replay check CORPUS`: wall time of the serial run against `--jobs 2` and `--ray` (a local single-node cluster),
side by side in one run, and the per-capture cost extrapolated to a 1,000-capture corpus.

    .venv/bin/python -m bench.corpus_bench [--captures 40] [--rounds 3] [--json]

The corpus: N builtin `tiny` captures (four workload shapes, 3-6 requests of 2-6 output tokens, one torch thread),
recorded once into a temporary directory. Each round runs the three ways in a rotating order, each as a fresh
`replay check DIR [--jobs 2 | --ray]` process (so every way pays its own start: interpreter and torch import,
worker processes, the Ray cluster), timed by wall clock and by the CPU time of the process and its children
(`resource.RUSAGE_CHILDREN`; Ray's workers belong to its raylet, not to us, so its CPU is undercounted and says so).
On a 2-core machine the speed-up is bounded by the cores. The extrapolation times each way on a second, 4-capture
corpus too (enough to start the worker processes and the Ray cluster): per capture = (wall(N) - wall(4)) / (N - 4),
start-up = wall(4) - 4 x per capture, 1,000 captures = start-up + 1,000 x per capture (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from replay.record import EngineOptions, SyntheticWorkload, record, synthetic

SMALL = 4  # captures in the corpus that measures start-up
WAYS = {"serial": [], "--jobs 2": ["--jobs", "2"], "--ray": ["--ray"]}
SHAPES = [dict(sampling="greedy"), dict(sampling="mixed"), dict(sampling="greedy", num_logprobs=None),
          dict(sampling="mixed", shared_prefix_fraction=0.8)]


def build_corpus(d: Path, n: int) -> None:
    """`n` small builtin captures in `d`."""
    for i in range(n):
        wl = SyntheticWorkload(num_requests=3 + i % 4, prompt_len=(4, 12 + i % 5), output_len=(2, 6), seed=i,
                               **SHAPES[i % len(SHAPES)])
        record(EngineOptions(model="tiny", threads=1), synthetic(wl, 512), d / f"w{i:03d}.capture")


def timed(corpus: Path, extra: list[str]) -> tuple[float, float]:
    """(wall s, CPU s of the process and its waited-for children) of one `replay check CORPUS ...` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "replay.cli", "check", str(corpus), *extra], capture_output=True,
                         text=True, env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"replay check {corpus} {' '.join(extra)} exited {out.returncode}: {out.stderr[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    """Print the table (or --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--captures", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.captures <= SMALL:
        ap.error(f"--captures must be more than {SMALL}")
    with tempfile.TemporaryDirectory(prefix="corpus-bench-") as tmp:
        big, small = Path(tmp) / "big", Path(tmp) / "small"
        big.mkdir()
        small.mkdir()
        build_corpus(big, args.captures)
        build_corpus(small, SMALL)
        names = list(WAYS)
        runs: dict[str, dict[str, list[float]]] = {w: {"wall": [], "cpu": [], "small": []} for w in names}
        for r in range(args.rounds):
            for w in names[r % len(names):] + names[:r % len(names)]:  # rotate the order every round
                wall, cpu = timed(big, WAYS[w])
                runs[w]["wall"].append(wall)
                runs[w]["cpu"].append(cpu)
                runs[w]["small"].append(timed(small, WAYS[w])[0])
    rows = []
    base = statistics.median(runs["serial"]["wall"])
    for w in names:
        wall, cpu, small_wall = runs[w]["wall"], runs[w]["cpu"], statistics.median(runs[w]["small"])
        per = max(statistics.median(wall) - small_wall, 0.0) / (args.captures - SMALL)
        start = max(small_wall - SMALL * per, 0.0)
        rows.append({"way": w, "wall_min": min(wall), "wall_median": statistics.median(wall), "wall_max": max(wall),
                     "vs_serial": base / statistics.median(wall), "cpu_median": statistics.median(cpu),
                     "start_s": start, "per_capture_s": per, "corpus_1000_s": start + 1000 * per})
    if args.json:
        json.dump({"captures": args.captures, "rounds": args.rounds, "cores": os.cpu_count(), "rows": rows},
                  sys.stdout, indent=1)
        print()
        return 0
    print(f"replay check over {args.captures} tiny captures, {args.rounds} rounds, {os.cpu_count()} cores "
          "(wall: min / median / max; CPU: the process and its children)")
    print(f"{'way':<10} {'wall s':>22} {'vs serial':>10} {'CPU s':>7} {'start s':>8} {'per capture':>12} "
          f"{'1,000 captures':>15}")
    for r in rows:
        print(f"{r['way']:<10} {r['wall_min']:6.1f} / {r['wall_median']:5.1f} / {r['wall_max']:5.1f} "
              f"{r['vs_serial']:9.2f}x {r['cpu_median']:7.1f} {r['start_s']:8.1f} {r['per_capture_s']:10.3f} s "
              f"{r['corpus_1000_s'] / 60:12.1f} min")
    print("Ray's workers are children of its raylet, not of `replay`: their CPU time is not in the --ray row.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
