"""What a snapshot of a large ring costs the engine: how long the engine's sends wait while the ring's writer process
seals a snapshot (docs/performance.md, "A snapshot of a large ring").

Method: a ring writer process (`ring_writer`, the one vLLM's tap starts, at nice 19) of SIZE bytes is filled with a
synthetic stream (`replay.record.synth`: 256 requests decoding at once, top-5 logprobs, a vocabulary of 151,936)
until its segments hold about SIZE. Then the engine side sends a step every PACE ms, as an engine would: for CONTROL
seconds without a snapshot (segments still rotate, each opening with a keyframe), then it triggers one (as a request
finished with an error does) and goes on until it is sealed. Every send's wall time on the engine side (the channel
is full when the writer process falls behind, and the send then waits), the time until the snapshot file appears,
and its size.

    .venv/bin/python -m bench.seal_bench [--size-mb N] [--pace-ms N] [--control-s S] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from replay.capture.flight.ring_process import ring_writer
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events

SHAPE = dict(running=256, num_logprobs=5, prompt_len=(1000, 2000), output_len=(500, 2000), vocab_size=151_936,
             block_size=16, seed=7)


def _send(w, ev) -> float:
    t = time.perf_counter()
    if ev.request is not None:
        w.add_request(ev.request, ev.step)
    else:
        w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
    return time.perf_counter() - t


def run(size_mb: int, pace_ms: float, after_s: float, control_s: float) -> dict:
    """Fill a ring of `size_mb`, then pace steps, trigger a snapshot and time every send until it is sealed."""
    with tempfile.TemporaryDirectory() as d:
        ring = Path(d) / "ring"
        w = ring_writer(ring, make_header("synthetic"), size_mb << 20, nice=19)
        events = synth_events(SynthShape(steps=10**7, **SHAPE))
        t0 = time.perf_counter()
        while sum(p.stat().st_size for p in ring.glob("segment-*.capture")) < (size_mb << 20) * 0.95:
            for _ in range(200):
                _send(w, next(events))
        fill_s = time.perf_counter() - t0
        segments_mb = sum(p.stat().st_size for p in ring.glob("segment-*.capture")) / 1e6
        control = _paced(w, events, pace_ms, lambda now: now > control_s)  # the same traffic, no snapshot
        sealed_at: list[float] = []

        def done(now: float) -> bool:
            if not sealed_at and any(ring.glob("snapshots/*.capture")):
                sealed_at.append(now)
            return bool(sealed_at) and now > sealed_at[0] + after_s or now > 900

        w.trigger("bench")
        waits = _paced(w, events, pace_ms, done)
        [snap] = list(ring.glob("snapshots/*.capture")) or [None]
        snap_mb = snap.stat().st_size / 1e6 if snap else 0.0
        w.close()
    return {"size_mb": size_mb, "pace_ms": pace_ms, "fill_s": round(fill_s, 1), "segments_mb": round(segments_mb, 1),
            "sealed_after_s": round(sealed_at[0] if sealed_at else -1, 2), "snapshot_mb": round(snap_mb, 1),
            "without a snapshot": _waits(control), "while one is sealed": _waits(waits)}


def _paced(w, events, pace_ms: float, done) -> list[float]:
    """Send a step every `pace_ms` until `done(seconds so far)`; each send's wall time."""
    waits: list[float] = []
    t0 = time.perf_counter()
    while not done(time.perf_counter() - t0):
        waits.append(_send(w, next(events)))
        time.sleep(max(0.0, pace_ms / 1e3 - waits[-1]))
    return waits


def _waits(waits: list[float]) -> dict:
    ms = sorted(x * 1e3 for x in waits)
    return {"steps": len(ms), "send_ms_median": round(statistics.median(ms), 3), "send_ms_max": round(ms[-1], 1),
            "blocked_s": round(sum(x for x in ms if x > 1.0) / 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=64)
    ap.add_argument("--pace-ms", type=float, default=10.0)
    ap.add_argument("--after-s", type=float, default=1.0, help="steps sent after the snapshot appears")
    ap.add_argument("--control-s", type=float, default=20.0, help="paced steps without a snapshot, first")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = run(a.size_mb, a.pace_ms, a.after_s, a.control_s)
    print(json.dumps(res) if a.json else "\n".join(f"{k:16} {v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
