"""Faults: crashes during record, a full disk, single-bit flips. Nothing is lost silently."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replay.capture import CaptureReader, Step
from replay.capture.reading.recover import recover
from replay.errors import CaptureError
from replay.inspect import capture_info
from replay.replayer import replay_capture

ROOT = Path(__file__).resolve().parents[2]
REPLAY = [sys.executable, str(ROOT / "cli.py")]


def _steps(path) -> list[int]:
    with CaptureReader(path) as r:
        return [x.index for x in r.records() if isinstance(x, Step)]


def _writers(out: Path) -> list[int]:
    """The writer processes recording into `out` (Linux). The writer detaches from the recorder (it forks away so
    that vLLM's kill of its engine's process tree cannot reach it), so it is found by its command line."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "replay.capture.writing.writer_child" in cmd and str(out) in cmd:
            pids.append(int(proc.name))
    return pids


def _start_record(out: Path, output_len: str = "32:96") -> subprocess.Popen:
    return subprocess.Popen(REPLAY + ["record", "--num-requests", "96", "--output-len", output_len, "--threads", "1",
                                      "--flush-interval", "0.2", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_until_recording(proc: subprocess.Popen, partial: Path) -> None:
    deadline = time.monotonic() + 60
    while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the recording has started once its .partial exists


def _wait_for_seal(out: Path, partial: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while partial.exists() and not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.slow
def test_sigkill_of_the_engine_leaves_a_sealed_capture_of_every_step_sent(tmp_path):
    """The engine dies at a random moment; its writer process sees the end of its pipe and seals the capture:
    a finished file (no .partial), `info` exit 0 with status "engine stopped", steps 0..N, a bitwise replay."""
    rnd = random.Random(7)
    print("kill-moment seed 7")
    outcomes = {"sealed": 0, "finished": 0, "before_header": 0}
    for i in range(5):  # (kill moments uniform over 2.5 s: most land mid-recording)
        out = tmp_path / f"k{i}.capture"
        partial = out.with_name(out.name + ".partial")
        proc = _start_record(out)
        _wait_until_recording(proc, partial)
        time.sleep(rnd.uniform(0.0, 2.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _wait_for_seal(out, partial)
        if not out.exists():
            assert not partial.exists() or _steps(partial) == [], "a .partial with data was left unsealed"
            outcomes["before_header"] += 1
            continue
        info = capture_info(out)  # what `replay info` prints (its exit code: 0 unless data was lost)
        assert info.complete and not info.damage, info
        if info.status == "ok":
            outcomes["finished"] += 1
            continue
        assert info.status.startswith("engine stopped:"), info.status
        outcomes["sealed"] += 1
        received = _steps(out)
        assert received == list(range(len(received)))
        if received:
            assert not replay_capture(out).diverged
    print(outcomes)
    assert outcomes["sealed"] >= 2


@pytest.mark.slow
def test_a_killed_writer_leaves_a_partial_that_recover_restores(tmp_path):
    """Real loss: the writer process itself is killed. Its flushed chunks stay, `info` says data was lost (exit 3),
    `recover` keeps every flushed step, and the recovered capture replays bitwise."""
    out = tmp_path / "w.capture"
    partial = out.with_name(out.name + ".partial")
    proc = _start_record(out, output_len="64:192")  # ~3 s of steps here: still recording when the writer dies
    _wait_until_recording(proc, partial)
    deadline = time.monotonic() + 60
    while partial.stat().st_size < 30_000 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # until some chunks are flushed (one is ~25 KB here): a fixed sleep outran a fast machine
    writers = _writers(out)
    assert writers, "no writer process found"
    for pid in writers:
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait()
    assert partial.exists() and not out.exists()
    res = subprocess.run(REPLAY + ["info", str(partial)], capture_output=True, text=True)
    assert res.returncode == 3 and "unfinished" in res.stdout, res.stdout + res.stderr
    received = _steps(partial)
    rec = recover(partial)
    assert _steps(rec.output) == received == list(range(len(received))) and received
    assert not replay_capture(rec.output).diverged


def test_full_disk_stops_recording_with_one_error_and_keeps_what_was_flushed(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        res = subprocess.run(REPLAY + ["record", "--num-requests", "96", "--output-len", "64:128", "--threads", "1",
                                       "--flush-interval", "0.05", "--out", str(mnt / "run.capture")],
                             capture_output=True, text=True, timeout=300)
        err = res.stderr.strip().splitlines()
        assert res.returncode != 0 and len(err) == 1 and "No space left on device" in err[0], res.stderr
        partial = mnt / "run.capture.partial"
        steps = _steps(partial)
        assert steps == list(range(len(steps))) and len(steps) > 0
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_thousand_single_bit_flips_are_detected_or_harmless(small_capture, tmp_path):
    data = small_capture.read_bytes()
    with CaptureReader(small_capture) as r:
        truth = list(r.records())
        chunks = [(c.offset, c.offset + c.length) for c in r.index.chunks]
    rnd = random.Random(1000)
    print("bit-flip seed 1000")
    flipped = tmp_path / "flip.capture"
    tally = {"detected": 0, "harmless": 0}
    for _ in range(1000):
        pos, bit = rnd.randrange(len(data)), rnd.randrange(8)
        buf = bytearray(data)
        buf[pos] ^= 1 << bit
        flipped.write_bytes(bytes(buf))
        try:
            with CaptureReader(flipped) as r:
                got = list(r.records())
                damage = list(r.damage)
        except CaptureError:
            tally["detected"] += 1  # refused whole (prologue or header chunk hit): nothing wrong was returned
            continue
        if damage:
            tally["detected"] += 1
            hit = [k for k, (a, b) in enumerate(chunks) if a <= pos < b]
            if hit:  # a flip inside a chunk is reported with that chunk
                assert hit[0] in {d.chunk for d in damage}, (pos, hit, damage)
            # and whatever was returned is exactly the original records, minus what was lost
            assert all(rec in truth for rec in got)
        else:
            tally["harmless"] += 1
            assert got == truth, f"flip at byte {pos} bit {bit} changed data silently"
    print(tally)
    assert tally["detected"] > 900


def test_no_pickle_in_the_package():
    for py in (ROOT / "replay").rglob("*.py"):
        text = py.read_text()
        assert "import pickle" not in text and "pickle.load" not in text, py
