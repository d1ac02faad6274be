"""The writer process's dealings with the operating system: a deep pipe read in large gulps, a life apart from the
engine's process tree, and its own CPU time (which, apart, the engine's rusage never counts)."""

from __future__ import annotations

import os
import signal
import struct
import time


def grow_pipe(fd: int) -> None:
    """A deeper pipe (Linux: up to pipe-max-size, 1 MiB by default) so that a burst of steps never makes the engine
    wait for the writer process; the writer only has to keep up on average."""
    try:
        import fcntl

        with open("/proc/sys/fs/pipe-max-size") as f:
            size = min(int(f.read()), 1 << 20)
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except (OSError, ValueError, ImportError):
        pass  # another OS, or a lower limit: the default pipe works, it only waits sooner


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


FRAME_HEAD = struct.Struct("<cI")  # a writer frame's head: kind (1 byte), payload length (u32 LE); pipe and ring


class FrameReader:
    """Frames `kind (1 byte) + length (u32 LE) + payload` from a pipe, read in gulps. Waking on every frame cost the
    writer process more CPU than handling them (vllm_bench, 3 frames per 10 ms step: ~40 µs of system and scheduler
    time per wake-up on this machine, ~0.1 ms per step), so after a small read it lets frames gather for `gulp_s`
    before reading again: one wake-up per `gulp_s` at most, in exchange for that much latency. A burst (a read of
    `GULP_BYTES` or more) is read on at once, so a fast engine never waits on a full pipe."""

    HEAD = FRAME_HEAD
    GULP_BYTES = 1 << 16
    READ_BYTES = 1 << 20

    def __init__(self, fd: int, gulp_s: float = 0.02):
        self.fd = fd
        self.gulp_s = gulp_s
        self._buf = b""  # immutable, so the frames handed out can be views of it (no copy per frame)
        self._pos = 0
        self._eof = False
        self._small = False  # the last read was small: wait for more before the next

    def _whole_frame(self) -> bool:
        avail = len(self._buf) - self._pos
        return avail >= 5 and avail >= 5 + self.HEAD.unpack_from(self._buf, self._pos)[1]

    def _fill(self) -> bool:
        if self._small and self.gulp_s:
            time.sleep(self.gulp_s)
        rest = self._buf[self._pos:] if self._pos < len(self._buf) else b""
        self._pos = 0
        missing = 5 + self.HEAD.unpack_from(rest)[1] - len(rest) if len(rest) >= 5 else 0
        if missing > self.READ_BYTES:  # inside a large frame: gather the rest of it, then join once
            parts = [rest]
            while missing > 0:
                data = os.read(self.fd, min(missing, 1 << 24))
                if not data:
                    break
                parts.append(data)
                missing -= len(data)
            self._buf, self._small, self._eof = b"".join(parts), False, missing > 0
            return not self._eof
        data = os.read(self.fd, self.READ_BYTES)
        self._small = len(data) < self.GULP_BYTES
        self._buf = rest + data if rest else data
        if not data:
            self._eof = True
            return False
        return True

    def next(self) -> tuple[bytes | None, memoryview | bytes | None]:
        """The next frame, waiting for it: (kind, payload, a read-only view); (None, b"") at the end of the pipe,
        (None, None) when the pipe ends inside a frame."""
        while not self._whole_frame():
            if self._eof or not self._fill():
                return None, (b"" if len(self._buf) == self._pos else None)
        kind, n = self.HEAD.unpack_from(self._buf, self._pos)
        start = self._pos + 5
        self._pos = start + n
        return kind, memoryview(self._buf)[start:start + n]


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
