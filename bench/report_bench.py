"""`replay report` on a long run: a 100,000-step synthetic capture of 256 running requests (`replay synth`), reported
through the command line as a user runs it; targets: under 60 s, under 10 MB.

    .venv/bin/python -m bench.report_bench [--steps N] [--running N] [--capture PATH] [--planted N] [--browser] [--json]

`--capture` reuses a capture made before (making the 100,000-step one takes minutes). `--planted N` also times the
comparison's part (heat map, scatter, per-request columns) with N divergences spread over the run's scheduled
(step, request) cells: a synthetic capture has no model to replay, so the divergences are made up, the numbers real.
`--browser` opens each page in headless Chromium and times it until its script has drawn everything.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
REPLAY = [sys.executable, "-m", "replay.cli"]


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, stdout) of a command that must succeed (exit 0 or 1)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout


def browser_seconds(page: Path) -> float | None:
    """Seconds headless Chromium takes to load `page` and run its script to the end (None without Chromium)."""
    exe = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as profile:
        t = time.perf_counter()
        out = subprocess.run([exe, "--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={profile}",
                              "--proxy-server=127.0.0.1:9", "--virtual-time-budget=60000", "--dump-dom",
                              page.resolve().as_uri()], capture_output=True, text=True, timeout=300)
        wall = time.perf_counter() - t
    if 'data-status="ready"' not in out.stdout:
        raise SystemExit(f"{page}: the page's script did not finish:\n{out.stdout[-1500:]}")
    return round(wall, 2)


def planted(capture: Path, out: Path, n: int, seed: int = 0) -> dict:
    """The comparison's cost with `n` made-up divergences in the run's scheduled cells (library calls, timed)."""
    from replay.diff import Divergence, Tolerance
    from replay.replayer import ReplayReport
    from replay.report import write_report
    from replay.report.run_facts import run_facts

    facts = run_facts(capture)
    rng = np.random.default_rng(seed)
    reqs = [f for f in facts.requests.values() if f.spans]
    picks = rng.integers(0, len(reqs), n)
    divs = []
    for i, k in enumerate(picks):
        f = reqs[k]
        a, b = f.spans[rng.integers(0, len(f.spans))]
        step = int(facts.index[rng.integers(a, b + 1)])
        flip = rng.random() < 0.01
        divs.append(Divergence(step, f.name, i, "token" if flip else "logprobs", 1, 2 if flip else 1,
                               max_abs_logprob_diff=float(10 ** rng.uniform(-7, 0)),
                               margin=float(10 ** rng.uniform(-4, 1)),
                               flip=("tie" if rng.random() < 0.5 else "confident") if flip else None,
                               internal_id=f.rid))
    divs.sort(key=lambda d: (d.step, d.kind != "token"))
    rep = ReplayReport(str(capture), "forced", True, divs[0], None, f"replay run {capture} --diff --steps "
                       f"{divs[0].step}-{divs[0].step} --mode forced", Tolerance(), [], len(facts.index), [], divs,
                       len(divs), None, 0.0, 0.0, first_token_flip=next((d for d in divs if d.kind == "token"), None))
    t = time.perf_counter()
    res = write_report(capture, out, replay=rep)
    return {"divergences": n, "seconds": round(time.perf_counter() - t, 2), "bytes": res.bytes}


def main() -> None:
    """Make (or take) the capture, report it, print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--capture", type=Path, help="report this capture instead of making one")
    ap.add_argument("--planted", type=int, default=0, help="also time a comparison with this many divergences")
    ap.add_argument("--browser", action="store_true", help="time each page in headless Chromium")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="report-bench-"))
    capture, out = args.capture, {}
    if capture is None:
        capture = work / "synth.capture"
        wall, _, _ = timed([*REPLAY, "synth", str(capture), "--steps", str(args.steps), "--running",
                            str(args.running)])
        out["synth_s"] = round(wall, 1)
    page = work / "report.html"
    wall, cpu, stdout = timed([*REPLAY, "report", str(capture), "-o", str(page)])
    out.update(capture=str(capture), page=str(page), capture_mb=round(capture.stat().st_size / 1e6, 1),
               report_s=round(wall, 1),
               report_cpu_s=round(cpu, 1), report_mb=round(page.stat().st_size / 1e6, 2), said=stdout.strip())
    if args.browser:
        out["browser_s"] = browser_seconds(page)
    if args.planted:
        out["planted"] = planted(capture, work / "planted.html", args.planted)
        if args.browser:
            out["planted"]["browser_s"] = browser_seconds(work / "planted.html")
    out["targets"] = [
        {"target": f"report of a {args.steps:,}-step capture in < 60 s", "measured": out["report_s"],
         "pass": out["report_s"] < 60},
        {"target": f"report of a {args.steps:,}-step capture < 10 MB", "measured": out["report_mb"],
         "pass": out["report_mb"] < 10},
    ]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>14}: {v}")
    shutil.rmtree(work, ignore_errors=True)  # the capture, when this made it, and the pages


if __name__ == "__main__":
    main()
