"""The writer process itself: read the engine's frames (`frame_protocol`, through shared memory or a pipe), write
them into a capture (or a ring's segments), and seal it when the engine closes, or when the engine goes away
without closing (a server stopped with SIGINT or SIGTERM, whose EngineCore vLLM force-kills within the second; a
SIGKILL), with the status "engine stopped". `ProcessCaptureWriter` (`writer_process`) starts it on the engine's side.

It detaches from the engine's process tree and ignores the stop signals (`detach`), so that nothing but the end of
its input ends it, and answers on stdout with one JSON line: `{"ok": ...}` or `{"error": "..."}`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from replay.capture.format import records as fmt
from replay.capture.writing import frame_protocol as fp
from replay.capture.writing import shm_channel
from replay.capture.writing.image_frames import ImageFrames
from replay.errors import CaptureError


def cpu_s() -> float:
    """This process's CPU time so far (user + system), at microsecond resolution where the OS gives it."""
    try:
        import resource

        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    except ImportError:
        t = os.times()
        return t.user + t.system


def detach() -> float:
    """Outlive the engine long enough to seal. vLLM's shutdown SIGKILLs every descendant of the EngineCore it finds
    (psutil's children, recursively), so the writer must not be one: it forks once more and the engine's own child
    exits at once, leaving the writer to init. Then a session of its own (a Ctrl-C or a kill of the engine's process
    group does not reach it) and no default handlers for the stop signals. The end of the pipe is what ends it.
    Returns the CPU time spent before the fork (imports), which the forked process's own count starts without."""
    before = cpu_s()
    if hasattr(os, "fork") and os.fork() > 0:
        os._exit(0)
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    return before if hasattr(os, "fork") else 0.0


def stopped_status(last_step: int, pending: dict | None = None, cut: bool = False) -> str:
    """The footer status of a capture the engine left without closing it: how a server stops (SIGINT or SIGTERM,
    after which vLLM force-kills its EngineCore), so a normal stop that lost nothing reads as one."""
    where = f"after step {last_step}" if last_step >= 0 else "before its first step"
    unfinished = ""
    if pending:
        steps = sorted(pending)
        unfinished = (f"; step {steps[0]} was running when it stopped (scheduled, never finished: not recorded)"
                      if len(steps) == 1 else
                      f"; steps {steps[0]}-{steps[-1]} were running when it stopped (scheduled, never finished: "
                      "not recorded)")
    whole = ("every whole record it sent is here; the one it was sending as it stopped was cut short and dropped"
             if cut else "complete: every record it sent is here")
    return (f"engine stopped: with the engine {where} (its process exited, or was stopped with SIGINT/SIGTERM); "
            f"{whole}{unfinished}")


def _capture_writer(options: dict, header: fmt.Header) -> Any:
    """The writer process's writer of one capture file."""
    from replay.capture.writing.writer import CaptureWriter

    return CaptureWriter(options["path"], header, overwrite=options["overwrite"], chunk_bytes=options["chunk_bytes"],
                         flush_interval=options["flush_interval"], level=options["level"],
                         keyframes=options.get("keyframes"))


def serve(options: dict, make_writer: Callable[[dict, fmt.Header], Any] = _capture_writer,
          lock: threading.Lock | None = None) -> int:
    """The writer process: read frames from stdin, write them with the writer `make_writer(options, header)` builds
    (a CaptureWriter; a ring of them in ring mode). `lock` is held while a frame is handled, so another thread (a
    ring's snapshot requests) may use the writer between frames."""
    from replay.errors import ReplayError

    if options.get("nice"):
        os.nice(options["nice"])  # the engine's threads come first; the deep pipe absorbs what waits
    out = sys.stdout
    # never read through sys.stdin: frames would hide in its buffer
    frames = (shm_channel.ChannelReader(options["channel_fd"], options["channel_bytes"], sys.stdin.fileno())
              if "channel_fd" in options else fp.FrameReader(sys.stdin.fileno()))

    def say(obj: dict) -> None:
        if "error" in obj and isinstance(frames, shm_channel.ChannelReader):
            frames.fail()  # the engine's next send stops, as a write into a closed pipe does
        out.write(json.dumps(obj) + "\n")
        out.flush()

    before_fork = detach()
    writer = None
    images = ImageFrames()
    try:
        kind, payload = frames.next()
        header = msgspec.msgpack.decode(payload, type=fmt.Header)
        writer = make_writer(options, header)
        if options.get("images"):
            images.warm()  # one-time work before "ready", not on the engine's first steps
        # its start-up CPU (imports, converters), for bench/; its pid (detached, it is no child of the engine's)
        say({"ok": "ready", "cpu_s": before_fork + cpu_s(), "pid": os.getpid()})
        lock = lock or contextlib.nullcontext()
        while True:
            kind, payload = frames.next()
            with lock:
                if _handle(writer, images, kind, payload, say, before_fork):
                    return 0
    except ReplayError as e:  # said first: the engine's sends stop before the writer finishes what it holds
        say({"error": str(e).split(": ", 1)[-1] if isinstance(e, CaptureError) else str(e)})
        if writer is not None:
            writer.abandon()
        return 1
    except Exception as e:  # noqa: BLE001 - reported to the engine as one line
        say({"error": f"capture writer process failed: {type(e).__name__}: {e}"})
        if writer is not None:
            writer.abandon()
        return 1


_DECODERS = {fp.REQUEST_ADDED: msgspec.msgpack.Decoder(fmt.RequestAdded),
             fp.REQUEST_ABORTED: msgspec.msgpack.Decoder(fmt.RequestAborted),
             fp.STEP: msgspec.msgpack.Decoder(fmt.Step[str])}


def _handle(writer: Any, images: ImageFrames, kind: bytes | None, payload: Any, say: Callable[[dict], None],
            before_fork: float) -> bool:
    """Handle one frame; True once the capture is sealed or abandoned (the writer process then exits)."""
    if kind is None:  # the engine went away without closing: seal what it sent
        writer.close(status=images.crash_status() or stopped_status(writer.last_step, images.pending,
                                                                     cut=payload is None))
        return True
    if kind == fp.QUIT:  # the engine gave up on the capture: keep what we have, no footer
        writer.abandon()
        return True
    if kind == fp.CLOSE:
        status = bytes(payload).decode()
        writer.close(status=images.crash_status() if status == "ok" and images.crash else status)
        # its CPU (it is no child of the engine's, see `detach`: the engine's rusage never counts it)
        say({"ok": "closed", "records": writer.num_records, "cpu_s": before_fork + cpu_s()})
        return True
    if kind == fp.FLUSH:
        writer.flush()
    elif kind in fp.IMAGE_FRAMES:
        images.write(writer, kind, payload)
    elif kind == fp.TROUBLE:  # a trouble the engine saw: a ring seals a snapshot (`SegmentRing.trigger`)
        if hasattr(writer, "trigger"):
            writer.trigger(bytes(payload).decode())
    elif kind == fp.CRASH:
        images.crash = msgspec.msgpack.decode(payload, type=fmt.Crash)
        writer.write_crash(images.crash)
    else:
        writer.write_record(_DECODERS[kind].decode(payload))  # S, A, X: a step, an arrival, an abort
    return False


if __name__ == "__main__":
    sys.exit(serve(json.loads(sys.argv[1])))
