"""Where `replay run --runner vllm` spends its time before and around the steps, at a real shape: a Qwen2 of 24
layers at Qwen2.5's vocabulary (151,936 ids), recorded by vLLM's offline engine through the tap, replayed on vLLM's
runner. Each phase is timed where it runs (wall, and this process's CPU):

  ours     reading the capture (header, keyframes), planning the engine (its arguments, the thread binding), and
           after vLLM's start: describing the replay as a header and comparing it with the recording's
  vLLM     `LLM(...)`: weights, the KV cache (profile) and the warm-up, as vLLM's own log times them
  steps    the replay loop itself (update_states, execute, sample); `diff` is ours, `close` vLLM's shutdown

The same capture is replayed `--rounds` times, each on a fresh engine, then as many times on one engine kept by
`Engines` (the reuse `check CORPUS` and scripts get).

    .venv/bin/python -m bench.startup_bench [--layers 24] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path


def _cpu() -> float:
    return time.process_time()


class Phases:
    """Wall and CPU seconds per phase, summed over calls."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    @contextmanager
    def timed(self, name: str):
        w, c = time.perf_counter(), _cpu()
        try:
            yield
        finally:
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w
            self.cpu[name] = self.cpu.get(name, 0.0) + _cpu() - c


def _wrap(phases: Phases, owner: object, attr: str, name: str) -> None:
    import inspect

    fn = getattr(owner, attr)

    def timed(*a, **k):
        with phases.timed(name):
            return fn(*a, **k)

    static = isinstance(inspect.getattr_static(owner, attr), staticmethod)
    setattr(owner, attr, staticmethod(timed) if static else timed)


def _vllm_log_times(log: Path, offset: int) -> dict[str, float]:
    """vLLM's own timings of its start, from the part of its log this replay wrote."""
    text = log.read_text(errors="replace")[offset:] if log.exists() else ""
    out = {}
    for key, pattern in (("weights", r"Loading weights took ([\d.]+) seconds"),
                         ("profile, KV cache, warm-up", r"warmup model\) took ([\d.]+) s")):
        found = re.findall(pattern, text)
        if found:
            out[key] = float(found[-1])
    return out


def one_replay(capture: Path, engines=None) -> dict:
    """One `replay_capture` on vLLM's runner with its phases timed."""
    import sys

    from replay.integrations.vllm import vllm_runner
    from replay.replayer import ReplayOptions, replay_capture
    from replay.replayer import build as build_module

    rc = sys.modules["replay.replayer.replay_capture"]  # (the package's `replay_capture` is the function)

    phases = Phases()
    saved = [(vllm_runner.VllmRunner, "_plan"), (vllm_runner.VllmRunner, "_start"),
             (vllm_runner.VllmRunner, "describe"), (build_module, "header_differences"),
             (rc, "start_at"), (rc, "CaptureReader"), (vllm_runner.VllmRunner, "run_step"),
             (vllm_runner.VllmRunner, "update_states"), (rc, "compare_step"), (vllm_runner.VllmRunner, "close")]
    import inspect

    originals = [(o, a, inspect.getattr_static(o, a)) for o, a in saved]
    names = ["plan", "vLLM start", "describe", "compare headers", "keyframes", "open capture", "steps", "steps",
             "diff", "close"]
    for (o, a), n in zip(saved, names, strict=True):
        _wrap(phases, o, a, n)
    log = Path(f"{capture}.vllm-replay.log")
    offset = log.stat().st_size if log.exists() else 0
    w, c = time.perf_counter(), _cpu()
    try:
        rep = replay_capture(capture, ReplayOptions(overrides={"runner": "vllm"}, engines=engines))
    finally:
        for o, a, f in originals:
            setattr(o, a, f)
    total_w, total_c = time.perf_counter() - w, _cpu() - c
    assert not rep.diverged, rep.first_divergence
    ours = ("open capture", "keyframes", "plan", "describe", "compare headers", "diff")
    return {"total_s": total_w, "total_cpu_s": total_c, "phases_s": phases.wall, "phases_cpu_s": phases.cpu,
            "ours_s": sum(phases.wall.get(p, 0.0) for p in ours), "vllm_log": _vllm_log_times(log, offset),
            "other_s": total_w - sum(phases.wall.values()), "steps": rep.steps_replayed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from replay.integrations.vllm.engines import Engines
    from testbed.checkpoints import real_vocab_qwen2
    from testbed.vllm_record import record

    tmp = Path(tempfile.mkdtemp(prefix="startup-"))
    model = real_vocab_qwen2(tmp / "qwen2", layers=args.layers)
    capture = record(model, tmp / "run.capture", prompts=8, first=20, step=10, max_tokens=16, seeded=True)
    fresh = [one_replay(capture) for _ in range(args.rounds)]
    with Engines() as engines:
        kept = [one_replay(capture, engines) for _ in range(args.rounds)]
    res = {"layers": args.layers, "fresh": fresh, "kept": kept}
    if args.json:
        print(json.dumps(res))
        return
    med = lambda xs: statistics.median(xs)  # noqa: E731
    keys = sorted({k for r in fresh for k in r["phases_s"]})
    print(f"replay run --runner vllm, {args.layers}-layer Qwen2 at vocab 151,936, {fresh[0]['steps']} steps; "
          f"median (min-max) of {args.rounds}, wall s (CPU s)")
    for label, rows in (("fresh engine", fresh), ("kept engine", kept)):
        print(f"{label}: total {med([r['total_s'] for r in rows]):.2f} "
              f"({min(r['total_s'] for r in rows):.2f}-{max(r['total_s'] for r in rows):.2f}), "
              f"CPU {med([r['total_cpu_s'] for r in rows]):.2f}")
        for k in keys:
            ws = [r["phases_s"].get(k, 0.0) for r in rows]
            cs = [r["phases_cpu_s"].get(k, 0.0) for r in rows]
            print(f"  {k:<16} {med(ws):7.3f} ({min(ws):.3f}-{max(ws):.3f})  CPU {med(cs):.3f}")
        print(f"  {'ours, in all':<16} {med([r['ours_s'] for r in rows]):7.3f}")
        print(f"  {'the rest':<16} {med([r['other_s'] for r in rows]):7.3f}")
        logs = [r["vllm_log"] for r in rows if r["vllm_log"]]
        if logs:
            print("  vLLM's log: " + ", ".join(f"{k} {med([x.get(k, 0.0) for x in logs]):.2f} s" for k in logs[0]))


if __name__ == "__main__":
    main()
