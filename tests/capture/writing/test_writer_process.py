"""ProcessCaptureWriter: the same capture as the in-process writer; errors surface; an engine crash loses nothing
that reached the writer process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from replay.capture import CaptureReader, CaptureWriter, Step
from replay.capture.writing import shm_channel
from replay.capture.writing.writer_process import ProcessCaptureWriter
from replay.errors import CaptureError, UsageError
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events
from tests.images import as_map, as_parts

WL = SynthShape(steps=30, running=6, prompt_len=(4, 40), output_len=(3, 20), num_logprobs=3, vocab_size=1000, seed=9)


# the transports between the engine and the writer process: the shared-memory channel (x86-64 Linux), one so small that
# it fills, wraps and splits steps into pieces all the time, and the pipe (every other machine)
TRANSPORTS = [pytest.param({"transport": "shm"}, id="shm"),
              pytest.param({"transport": "shm", "channel_bytes": 4096}, id="small-shm"),
              pytest.param({"transport": "pipe"}, id="pipe")]
if not shm_channel.available():
    TRANSPORTS = TRANSPORTS[2:]


def _write(writer_cls, path, **options):
    with writer_cls(path, make_header("test"), chunk_bytes=2000, **options) as w:
        for ev in synth_events(WL):
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
            else:
                w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
        w.abort_request("gone", 30)
    return w


def _records(path):
    with CaptureReader(path) as r:
        return [x for x in r.records() if type(x).__name__ not in ("Header", "Footer")]


@pytest.mark.parametrize("options", TRANSPORTS)
def test_same_records_as_the_in_process_writer(tmp_path, options):
    _write(CaptureWriter, tmp_path / "thread.capture")
    w = _write(ProcessCaptureWriter, tmp_path / "process.capture", **options)
    assert w.transport == options["transport"]
    assert _records(tmp_path / "thread.capture") == _records(tmp_path / "process.capture")
    # the writer process says what it cost (it is no child of ours: its CPU is not in our rusage), for bench/
    assert 0 < w.startup_cpu_s < w.cpu_s


def test_errors_surface_in_the_engine_process(tmp_path, small_capture):
    with pytest.raises(UsageError, match="already exists"):
        ProcessCaptureWriter(small_capture, make_header("test"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CaptureError, match="cannot create capture"):
        ProcessCaptureWriter(blocker / "sub" / "x.capture", make_header("test"))
    with pytest.raises(UsageError, match="writer transport 'carrier pigeon'"):
        ProcessCaptureWriter(tmp_path / "y.capture", make_header("test"), transport="carrier pigeon")


@pytest.mark.parametrize("options", TRANSPORTS)
def test_a_killed_writer_process_stops_the_engine_with_one_error(tmp_path, options):
    """The writer process dies under the engine (SIGKILL): the engine's sends raise CaptureError soon after (the
    pipe: at once; shared memory: within its liveness period), never silently into nowhere."""
    events = [ev for ev in synth_events(WL) if ev.request is None]
    w = ProcessCaptureWriter(tmp_path / "k.capture", make_header("test"), **options)
    os.kill(w.writer_pid, signal.SIGKILL)
    time.sleep(0.2)
    sent = 0
    with pytest.raises(CaptureError, match="capture writer process"):
        for _ in range(40):
            for ev in events:
                w.write_step(sent, ev.scheduler_output, ev.model_runner_output)
                sent += 1
    assert sent <= shm_channel.ChannelSender.LIVENESS_EVERY
    w.abandon()


_KILLED = r"""
import os, signal, sys
from replay.capture.writing.writer_process import ProcessCaptureWriter
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events
w = ProcessCaptureWriter(sys.argv[1], make_header("test"), flush_interval=60)
n = 0
for ev in synth_events(SynthShape(steps=40, running=4, prompt_len=(4, 8), output_len=(2, 6), seed=3)):
    if ev.request is not None:
        w.add_request(ev.request, ev.step)
    else:
        w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
        n += 1
print(n, flush=True)
os.kill(os.getpid(), signal.SIGKILL)   # the engine dies: no close, no flush
"""


@pytest.mark.parametrize("options", TRANSPORTS)
def test_an_engine_killed_without_closing_leaves_a_sealed_capture_of_every_record_sent(tmp_path, options):
    path = tmp_path / "crash.capture"
    code = _KILLED.replace('make_header("test")', f'make_header("test"), **{options!r}')
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    written = int(out.stdout.strip())
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:  # the orphaned writer process seals on its own
        time.sleep(0.1)
    with CaptureReader(path) as r:
        steps = [x.index for x in r.records() if isinstance(x, Step)]
        assert r.complete and not r.damage
        assert r.index.status == ("engine stopped: with the engine after step 39 (its process exited, or was stopped "
                                  "with SIGINT/SIGTERM); complete: every record it sent is here")
    assert steps == list(range(written)) and written == 40
    assert not path.with_name(path.name + ".partial").exists()


def test_images_of_foreign_objects_give_the_same_records(tmp_path):
    """The vLLM tap's route: the engine thread sends msgpack images, the writer process converts them."""
    _write(CaptureWriter, tmp_path / "contracts.capture")
    enc = msgspec.msgpack.Encoder()
    with ProcessCaptureWriter(tmp_path / "images.capture", make_header("test"), chunk_bytes=2000) as w:
        for ev in synth_events(WL):
            if ev.request is not None:
                w.add_request_image(enc.encode(as_map(ev.request)), ev.step)
            else:
                w.write_step_image(ev.step, enc.encode(as_map(ev.scheduler_output)),
                                   enc.encode(as_map(ev.model_runner_output)))
        w.abort_request("gone", 30)
    assert _records(tmp_path / "contracts.capture") == _records(tmp_path / "images.capture")


@pytest.mark.parametrize("options", TRANSPORTS)
@pytest.mark.parametrize("parts", [False, True])
def test_steps_sent_as_the_engine_lives_them_give_the_same_records(tmp_path, parts, options):
    """The vLLM tap's frames: each step's SchedulerOutput image when scheduled, its output (whole, or with the
    logprob matrices apart) when it ends."""
    from replay.capture.format import records as fmt

    with CaptureWriter(tmp_path / "contracts.capture", make_header("test"), chunk_bytes=2000) as w:
        for ev in synth_events(WL):
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
            else:
                w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output, timing=fmt.StepTiming(1, 2, 3, 4))
    enc = msgspec.msgpack.Encoder()
    with ProcessCaptureWriter(tmp_path / "frames.capture", make_header("test"), chunk_bytes=2000, images=True,
                              **options) as w:
        for ev in synth_events(WL):
            if ev.request is not None:
                w.add_request_image(enc.encode(as_map(ev.request)), ev.step)
            else:
                w.scheduled_image(ev.step, enc.encode(as_map(ev.scheduler_output)), 1, 2)
                mro = ev.model_runner_output
                w.output_image(ev.step, as_parts(mro) if parts else enc.encode(as_map(mro)), 3, 4)
    assert _records(tmp_path / "contracts.capture") == _records(tmp_path / "frames.capture")


def _zombie_children() -> list[int]:
    """This process's children that have exited and not been reaped (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            out.append(int(stat.parent.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_no_zombie_stays_under_the_engine_while_it_records(tmp_path):
    """The writer process is forked away from the engine's process tree (vLLM kills that tree at shutdown); the
    child that forked it exits at once and must be reaped then, not at close: `ps` under a server shows no
    `<defunct>` for a week of recording."""
    with ProcessCaptureWriter(tmp_path / "z.capture", make_header("test")) as w:
        time.sleep(0.2)
        assert _zombie_children() == []
        assert w.writer_pid not in [c for c in _zombie_children()]
