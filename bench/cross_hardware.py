"""How far a capture's numbers move on this machine's hardware: the figure `--tolerance auto` rests on.

    .venv/bin/python -m bench.cross_hardware CAPTURE [CAPTURE ...] [--json]

Replays each capture on the builtin runner with every difference measured (no tolerance hides one) and prints,
side by side: where it was recorded and where it replays, the hardware differences `replay` names, the largest
|Δlogprob|, token flips, and what `--tolerance auto` takes. Run it on captures recorded on another processor
(the golden captures as committed before hardware provenance, `git show 7e10994:captures/tiny-mixed.capture`, were
recorded on an AVX512 machine) to measure the cross-hardware drift; on this machine's own captures it reads 0.
"""

from __future__ import annotations

import argparse
import json
import sys

from replay.capture import CaptureReader
from replay.diff import Tolerance
from replay.provenance import current_hardware, hardware_summary
from replay.replayer import ReplayOptions, replay_capture


def measure(path: str) -> dict:
    """One capture: recorded and replay hardware, the drift between them, and auto's choice."""
    with CaptureReader(path) as r:
        env = r.header.environment
    loose = replay_capture(path,
                           ReplayOptions(tolerance=Tolerance(atol=1e9)))  # every token compared, no logprob hidden
    auto = replay_capture(path, ReplayOptions(auto_tolerance=True))
    return {
        "capture": path,
        "recorded_on": hardware_summary(env.hardware) if env.hardware else "not named",
        "recorded_kernels": env.libraries.get("cpu_capability", "?"),
        "replayed_on": hardware_summary(current_hardware()),
        "differences": list(auto.environment_differences),
        "max_abs_logprob_diff": max((s.max_abs_logprob_diff for s in loose.steps), default=0.0),
        "token_flips": sum(s.token_mismatches for s in loose.steps),
        "tokens_compared": loose.tokens_compared,
        "auto": auto.tolerance_choice,
        "auto_verdict": "DIVERGED" if auto.diverged else "MATCH",
    }


def main(argv: list[str] | None = None) -> int:
    """Print one block per capture (or --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("captures", nargs="+")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = [measure(p) for p in args.captures]
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    for row in rows:
        print(f"{row['capture']}\n  recorded on  {row['recorded_on']} (ATen kernels {row['recorded_kernels']})\n"
              f"  replayed on  {row['replayed_on']}\n"
              f"  drift        max |Δlogprob| {row['max_abs_logprob_diff']:.3g}, {row['token_flips']} token flips "
              f"of {row['tokens_compared']}\n"
              f"  auto         {row['auto_verdict']}: {row['auto']}")
        for d in row["differences"]:
            print(f"  note         {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
