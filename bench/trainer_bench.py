"""What `replay trainer`'s forward costs: wall and CPU seconds and the process's peak memory, padded and packed.

The trainer's side of a real-vocabulary rollout batch: a Qwen2 at Qwen2.5's vocabulary (151,936 ids; `testbed`'s
random-weight checkpoint, float32), 16 rollouts of a 400-600-token prompt and 64 generated tokens, micro-batches
of 8, teacher-forced through `transformers` as `replay trainer` runs them (`replay.trainer.forward`). The vocabulary
makes the logits most of the memory, so what matters is at how many positions they are computed. Each case runs in
a fresh process (its peak RSS is its own); rounds interleave the cases; median (min-max).

    .venv/bin/python -m bench.trainer_bench [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("padded", "packed")


def _one(model: str, case: str) -> dict:
    """One forward of the batch in this process: its seconds and peak RSS."""
    from replay.contracts import SamplingParams
    from replay.trainer.forward import load_model, teacher_forced
    from replay.trainer.rollouts import Rollout

    rng = random.Random(0)
    rollouts = []
    for i in range(16):
        prompt = [rng.randrange(151_000) for _ in range(rng.randint(400, 600))]
        tokens = [rng.randrange(151_000) for _ in range(64)]
        rollouts.append(Rollout(f"r{i}", prompt, tokens, [0.0] * 64, list(range(64)), SamplingParams()))
    m = load_model(model, "float32", "sdpa")
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in teacher_forced(m, rollouts, 8, pack=case == "packed"):
        pass
    return {"case": case, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _spread(xs: list[float], fmt: str = ".3g") -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def main() -> None:
    """Run the rounds and print the table (or --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "CASE"), help=argparse.SUPPRESS)  # a case's own process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(*args.one)))
        return
    from testbed.checkpoints import real_vocab_qwen2

    with tempfile.TemporaryDirectory() as tmp:
        model = str(real_vocab_qwen2(Path(tmp) / "qwen2-vocab"))
        runs: dict[str, list[dict]] = {c: [] for c in CASES}
        for _ in range(args.rounds):
            for case in CASES:
                out = subprocess.run([sys.executable, "-m", "bench.trainer_bench", "--one", model, case],
                                     capture_output=True, text=True, check=True).stdout
                runs[case].append(json.loads(out.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(runs))
        return
    print("| batch | wall s | CPU s | peak RSS MB |\n|---|---|---|---|")
    for case, rs in runs.items():
        print(f"| {case} | {_spread([r['wall_s'] for r in rs])} | {_spread([r['cpu_s'] for r in rs])} | "
              f"{_spread([r['peak_rss_mb'] for r in rs], '.0f')} |")


if __name__ == "__main__":
    main()
