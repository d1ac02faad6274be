"""Keyframe cost: what the writer's shadow of the request table costs per step, and what one keyframe costs, at 256
live requests with long contexts (docs/design.md, "The flight recorder").

Method: a synthetic engine stream (`replay.record.synth`: 256 requests decoding at once, prompts of 1,000-2,000
tokens, outputs of 500-2,000, top-5 logprobs, 16-token blocks) written by a `CaptureWriter` three ways, in rotating
order over ROUNDS rounds: without keyframes (`--keyframe-steps 0`: the writer keeps no shadow), with the default
interval (the shadow folds every chunk it seals; a keyframe every 4,096 steps, none in this run), and with a
keyframe every 256 steps. CPU time of this process (the writer process's work: encoding, folding, compressing on
the emitter's threads) per step, min / median / max; and for the keyframes themselves: their bytes before and after
compression (zstd level 3, as their chunk is) and the time to build one. With `--ring-steps N`, then, a ring
(`SegmentRing`, SIZE 16 MB) written for N steps of the same stream shape: this process's RSS and the ring's bytes on
disk at every tenth, so that a long run shows whether memory and disk stay flat.

    .venv/bin/python -m bench.keyframe_bench [--steps N] [--rounds N] [--ring-steps N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import zstandard

from replay.capture import CaptureWriter, Step
from replay.capture.format import records as fmt
from replay.capture.format.shadow import ShadowTable
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events

SHAPE = dict(running=256, num_logprobs=5, prompt_len=(1000, 2000), output_len=(500, 2000), vocab_size=151_936,
             block_size=16, seed=7)
VARIANTS = {"no keyframes": 0, "default (shadow only)": 4096, "every 256 steps": 256}


def _events(steps: int) -> list:
    return list(synth_events(SynthShape(steps=steps, **SHAPE)))


def _write(events: list, path: Path, keyframes: int) -> dict:
    header = make_header("synthetic")
    c0, t0 = time.process_time(), time.perf_counter()
    with CaptureWriter(path, header, keyframes=keyframes, overwrite=True) as w:
        for ev in events:
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
            else:
                w.write_step_record(Step(ev.step, ev.scheduler_output, ev.model_runner_output))
    steps = sum(ev.request is None for ev in events)
    return {"cpu_ms_per_step": (time.process_time() - c0) * 1e3 / steps,
            "wall_ms_per_step": (time.perf_counter() - t0) * 1e3 / steps, "bytes": path.stat().st_size}


def keyframe_sizes(events: list) -> dict:
    """One keyframe at the end of the stream: live requests, tokens, raw and compressed bytes, build time."""
    header = make_header("synthetic")
    shadow = ShadowTable(header.engine_config.block_size, header.engine_config.enable_prefix_caching)
    for ev in events:
        if ev.request is not None:
            shadow.add_request(ev.request, ev.step)
        else:
            shadow.step(ev.step, ev.scheduler_output, ev.model_runner_output)
    t = time.perf_counter()
    kf = shadow.keyframe()
    build_ms = (time.perf_counter() - t) * 1e3
    raw = fmt.WIRE_ENCODER.encode(kf)
    z = zstandard.ZstdCompressor(level=fmt.DEFAULT_LEVEL).compress(raw)
    tokens = sum(len(r.request.prompt_token_ids or ()) + len(r.output_token_ids) for r in kf.requests)
    return {"live_requests": len(kf.requests), "tokens": tokens, "raw_bytes": len(raw), "zstd_bytes": len(z),
            "bytes_per_token": len(z) / tokens, "build_ms": build_ms}


def run(steps: int, rounds: int) -> dict:
    events = _events(steps)
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory() as d:
        for i in range(rounds):
            for v in names[i % len(names):] + names[: i % len(names)]:  # rotating order: each sees every slot
                results[v].append(_write(events, Path(d) / f"{i}.capture", VARIANTS[v]))
    out = {"steps": steps, "rounds": rounds, "shape": SHAPE, "variants": {}}
    for v, rs in results.items():
        cpu = [r["cpu_ms_per_step"] for r in rs]
        out["variants"][v] = {"cpu_ms_per_step": {"min": min(cpu), "median": statistics.median(cpu), "max": max(cpu)},
                              "wall_ms_per_step_median": statistics.median(r["wall_ms_per_step"] for r in rs),
                              "bytes": rs[-1]["bytes"]}
    out["keyframe"] = keyframe_sizes(events)
    return out


def ring_rss(steps: int, size: int = 16 << 20) -> dict:
    """RSS (MB) and bytes on disk at each tenth of a ring written for `steps` steps (the stream made as it goes)."""
    import os

    from replay.capture.flight.segments import SegmentRing

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

    marks = {max(steps * k // 10 - 1, 0) for k in range(1, 11)}
    rss, disk = [], []
    with tempfile.TemporaryDirectory() as d:
        ring = SegmentRing(Path(d) / "ring", make_header("synthetic"), size=size)
        for ev in synth_events(SynthShape(steps=steps, **SHAPE)):
            if ev.request is not None:
                ring.add_request(ev.request, ev.step)
                continue
            ring.write_record(Step(ev.step, ev.scheduler_output, ev.model_runner_output))
            if ev.step in marks:
                rss.append(round(rss_mb(), 1))
                disk.append(round(sum(p.stat().st_size for p in ring.layout.dir.glob("segment-*")) / 1e6, 2))
        ring.close()
        segments = ring.segments_written
    return {"steps": steps, "size_mb": size / 1e6, "rss_mb": rss, "disk_mb": disk, "segments_written": segments}


def render(res: dict) -> str:
    """The results as a table."""
    lines = [f"{res['steps']} steps, 256 live requests, prompts 1,000-2,000 tokens, {res['rounds']} rounds "
             "(writer CPU per step: min / median / max)"]
    for v, r in res["variants"].items():
        c = r["cpu_ms_per_step"]
        lines.append(f"  {v:<24} {c['min']:.3f} / {c['median']:.3f} / {c['max']:.3f} ms   capture {r['bytes']:,} B")
    k = res["keyframe"]
    lines.append(f"one keyframe: {k['live_requests']} live requests, {k['tokens']:,} tokens, {k['raw_bytes']:,} B raw, "
                 f"{k['zstd_bytes']:,} B compressed ({k['bytes_per_token']:.2f} B/token), built in "
                 f"{k['build_ms']:.1f} ms")
    if "ring" in res:
        r = res["ring"]
        lines.append(f"a {r['size_mb']:.0f} MB ring over {r['steps']:,} steps ({r['segments_written']} segments "
                     f"written), "
                     f"at each tenth: RSS {r['rss_mb']} MB; on disk {r['disk_mb']} MB")
    return "\n".join(lines)


def main() -> None:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ring-steps", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = run(a.steps, a.rounds)
    if a.ring_steps:
        res["ring"] = ring_rss(a.ring_steps)
    print(json.dumps(res) if a.json else render(res))


if __name__ == "__main__":
    main()
