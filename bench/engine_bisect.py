"""The README's "a TP=2 divergence down to the module" recipe, run for real: prints every command and its output.

    .venv/bin/python -m bench.engine_bisect [--keep DIR]

1. A vLLM OpenAI server at tensor-parallel size 2 (two CPU workers, vLLM's multiprocess executor) on a random
   2-layer Qwen2 with Qwen2.5's vocabulary (151,936 ids; 4 heads, 2 K/V heads: each rank holds half), recorded with
   REPLAY_CAPTURE, serves 8 concurrent greedy clients (top-5 logprobs) and is stopped with SIGTERM.
2. `replay run --runner vllm` on the recorded layout, then with `--set tensor_parallel_size=1`, and `bisect layers`
   at the first divergence against tensor_parallel_size=1.
3. `bisect batch` on vLLM's runner and on ours, on an offline capture of a Llama wide enough for float32 batch
   variance (`testbed.checkpoints.wide_llama`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from replay.integrations.vllm.layout import omp_threads_bind
from testbed.checkpoints import add_tokenizer, real_vocab_qwen2, wide_llama
from testbed.vllm_record import record


def replay(*args: str) -> subprocess.CompletedProcess:
    """One `replay` command, printed as typed and as it answered."""
    print("$ replay " + " ".join(args), flush=True)
    out = subprocess.run([sys.executable, "-m", "replay.cli", *args, "-q"] if args[0] == "bisect" else
                         [sys.executable, "-m", "replay.cli", *args], capture_output=True, text=True)
    print((out.stdout + out.stderr).rstrip(), flush=True)
    return out


def wait_up(proc: subprocess.Popen, port: int, capture: Path) -> None:
    """Until the server on `port` answers /health (SystemExit if it exits, or after 10 minutes)."""
    deadline = time.monotonic() + 600
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not come up; see {capture}.server.log")
            time.sleep(1)


def serve(model: Path, capture: Path) -> None:
    """A TP=2 server recorded to `capture`, 8 concurrent clients, then SIGTERM."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, REPLAY_CAPTURE=str(capture),
               VLLM_CPU_OMP_THREADS_BIND=omp_threads_bind({"tensor_parallel_size": "2"}, {}, "cpu") or "0|1")
    log = open(f"{capture}.server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--dtype", "float32", "--max-model-len", "512", "--block-size", "32", "--enforce-eager",
                             "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--port",
                             str(port), "--kv-cache-memory-bytes", str(256 << 20)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    wait_up(proc, port, capture)

    def post(i: int) -> dict:
        body = {"model": str(model), "prompt": [(37 * i + 11 * j) % 150_000 + 3 for j in range(8 + 5 * i)],
                "max_tokens": 16, "temperature": 0, "logprobs": 5}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(post, range(8)))
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", type=Path, help="work here and keep the checkpoints and captures")
    args = ap.parse_args()
    d = args.keep or Path(tempfile.mkdtemp(prefix="engine-bisect-"))
    d.mkdir(parents=True, exist_ok=True)
    cap = d / "tp2.capture"
    if not cap.exists():
        serve(add_tokenizer(real_vocab_qwen2(d / "qwen2-vocab", heads=4, kv_heads=2)), cap)
    replay("info", str(cap))
    replay("run", str(cap), "--diff", "--runner", "vllm")
    out = replay("run", str(cap), "--diff", "--runner", "vllm", "--set", "tensor_parallel_size=1")
    first = json.loads(subprocess.run([sys.executable, "-m", "replay.cli", "run", str(cap), "--diff", "--runner",
                                       "vllm", "--set", "tensor_parallel_size=1", "--json"], capture_output=True,
                                      text=True).stdout)["first_divergence"] if out.returncode == 1 else None
    if first is not None:
        replay("bisect", "layers", str(cap), "--runner", "vllm", "--step", str(first["step"]), "--request",
               first["request_id"], "--against", "tensor_parallel_size=1", "--dump", str(d / "dump"))
    wide = d / "wide.capture"
    if not wide.exists():
        record(wide_llama(d / "wide-llama"), wide, prompts=8, first=20, step=40, max_tokens=4)
    replay("bisect", "batch", str(wide), "--step", "2", "--request", "7", "--runner", "vllm")
    replay("bisect", "batch", str(wide), "--step", "2", "--request", "7")


if __name__ == "__main__":
    main()
