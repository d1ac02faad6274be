"""Load: a long synthetic capture (default 100,000 steps, 256 concurrent requests) recorded and read back, with
memory sampled while recording and while scanning, and one random step looked up through the index.

    .venv/bin/python -m bench.load [--steps N] [--running N] [--json]

Prints RSS (MB) at each tenth of the recording and of the scan, the file size, and how many chunks a
`show --step` lookup decompressed. Used by tests/test_load.py (which asserts flat memory) and quoted in the README.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from replay.capture import CaptureReader, CaptureWriter, Step
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events


def rss_mb() -> float:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def run(steps: int, running: int, out: Path) -> dict:
    """Record, scan, look up; return the measurements."""
    w = SynthShape(steps=steps, running=running, num_logprobs=None, prompt_len=(16, 128), output_len=(64, 512), seed=1)
    marks = {max(steps * k // 10 - 1, 0) for k in range(1, 11)}
    rec_rss, t = [], time.perf_counter()
    with CaptureWriter(out, make_header("synthetic"), overwrite=True) as writer:
        for ev in synth_events(w):
            if ev.request is not None:
                writer.add_request(ev.request, ev.step)
            else:
                writer.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
                if ev.step in marks:
                    rec_rss.append(round(rss_mb(), 1))
    record_s = time.perf_counter() - t
    scan_rss, n, t = [], 0, time.perf_counter()
    with CaptureReader(out) as r:
        for rec in r.records():
            if isinstance(rec, Step):
                n += 1
                if rec.index in marks:
                    scan_rss.append(round(rss_mb(), 1))
    scan_s = time.perf_counter() - t
    with CaptureReader(out) as r:
        touched = []
        inner = r._decompress
        r._decompress = lambda ref: touched.append(ref.number) or inner(ref)
        t = time.perf_counter()
        assert r.step(steps * 7 // 9).index == steps * 7 // 9
        lookup_ms = (time.perf_counter() - t) * 1e3
        num_chunks = len(r.index.chunks)
    return {"steps": steps, "running": running, "steps_read": n, "file_mb": round(out.stat().st_size / 1e6, 2),
            "chunks": num_chunks, "record_s": round(record_s, 1), "scan_s": round(scan_s, 1),
            "record_rss_mb": rec_rss, "scan_rss_mb": scan_rss, "lookup_ms": round(lookup_ms, 1),
            "lookup_chunks": len(touched)}


def main() -> None:
    """Parse flags, run, print."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        res = run(args.steps, args.running, Path(d) / "load.capture")
    if args.json:
        print(json.dumps(res))
        return
    print(f"{res['steps']:,} steps x {res['running']} running requests: {res['file_mb']} MB in {res['chunks']} chunks; "
          f"recorded in {res['record_s']} s, scanned in {res['scan_s']} s")
    print(f"RSS while recording (MB, each tenth): {res['record_rss_mb']}")
    print(f"RSS while scanning  (MB, each tenth): {res['scan_rss_mb']}")
    print(f"step lookup through the index: {res['lookup_ms']} ms, {res['lookup_chunks']} chunk decompressed")


if __name__ == "__main__":
    main()
