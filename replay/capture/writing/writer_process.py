"""`ProcessCaptureWriter`: the `CaptureWriter` API, with interning, compression and I/O in a child process.

The engine thread only msgspec-encodes each record (tens of µs) and hands the bytes over (shared memory, or a pipe;
below). Everything else (id interning, the logprob transforms, zstd, the file) runs in a separate Python process, so
it can never take the engine's interpreter lock: a background *thread* doing the same Python work measurably slows a
Python-heavy engine step. A bonus: if the engine process goes away without closing the capture (a server stopped
with SIGINT or SIGTERM, whose EngineCore vLLM force-kills within the second; a SIGKILL; an interpreter exit that
skipped our hooks), the writer process (`writer_child`) reads the end of its pipe and seals the capture itself:
footer, seek index, rename, with the status "engine stopped" (nothing handed over is lost). It runs in its own
session, outside the engine's process tree, and ignores SIGINT, SIGTERM and SIGHUP, so neither a Ctrl-C, nor a kill
of the engine's process group, nor vLLM killing the EngineCore's descendants takes it down before it has sealed; it
exits as soon as it has.

Transport: on x86-64 Linux the frames go through shared memory (`shm_channel`: a copy, no system call on the
engine thread), the child's stdin then carrying only wake-up bytes and, by its end, the engine's; elsewhere (or with
REPLAY_WRITER_TRANSPORT=pipe) they go through the pipe itself. The frames, their kinds and payloads are
`frame_protocol`'s. The child answers on stdout with one JSON line: `{"ok": ...}` or `{"error": "..."}` (and,
through the channel, sets its `failed` word first, so the engine's next send stops).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

from replay.capture.codec.step_image import OutputParts
from replay.capture.format import records as fmt
from replay.capture.writing import frame_protocol as fp
from replay.capture.writing import shm_channel
from replay.capture.writing.context import WriterContext
from replay.capture.writing.wire import output_frame, scheduled_frame
from replay.contracts import EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from replay.errors import CaptureError, UsageError

_ENCODER = msgspec.msgpack.Encoder()
TRANSPORT_ENV = "REPLAY_WRITER_TRANSPORT"  # "shm" or "pipe"; unset: shared memory where `shm_channel.available()`
CHILD = "replay.capture.writing.writer_child"  # the writer process's module (a ring's: replay.capture.flight)


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


class ProcessCaptureWriter(WriterContext):
    """Writes a capture through a child process; same methods as `CaptureWriter`."""

    def __init__(self, path: str | os.PathLike, header: fmt.Header, *, overwrite: bool = False,
                 chunk_bytes: int = fmt.DEFAULT_CHUNK_BYTES, flush_interval: float = fmt.DEFAULT_FLUSH_INTERVAL,
                 level: int = fmt.DEFAULT_LEVEL, nice: int = 0, images: bool = False, transport: str | None = None,
                 channel_bytes: int = shm_channel.DEFAULT_CHANNEL_BYTES, keyframes: int | None = None,
                 child: str = CHILD, child_options: dict | None = None):
        self.path = Path(path)
        self.partial_path = self.path.with_name(self.path.name + ".partial")
        if not overwrite and self.path.exists():
            raise UsageError(f"{self.path}: already exists (pass overwrite=True / --force to replace it)")
        options = {"path": str(self.path), "overwrite": overwrite, "chunk_bytes": chunk_bytes,
                   "flush_interval": flush_interval, "level": level, "nice": nice, "images": images,
                   "keyframes": keyframes, **(child_options or {})}
        asked = transport or os.environ.get(TRANSPORT_ENV)
        transport = asked or ("shm" if shm_channel.available() else "pipe")
        if transport not in ("shm", "pipe") or (transport == "shm" and not shm_channel.available()):
            raise UsageError(f"writer transport {transport!r}: 'pipe'" + (" or 'shm'" if shm_channel.available()
                                                                          else ""))
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[3])  # the child must import this very package
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else root
        read_end, self._fd = os.pipe()
        self._channel = None
        if transport == "shm":
            try:
                self._channel = shm_channel.ChannelSender(self._fd, channel_bytes)
            except OSError as e:  # no memfd here (a sandbox's seccomp, no memory): the pipe, unless shm was asked
                if asked:
                    os.close(read_end)
                    os.close(self._fd)
                    raise CaptureError(self.partial_path,
                                       f"cannot make the writer's shared-memory channel: {e}") from None
                transport = "pipe"
        if self._channel is not None:
            options.update(channel_fd=self._channel.fd, channel_bytes=channel_bytes)
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", child, json.dumps(options)],
                                          stdin=read_end, stdout=subprocess.PIPE, env=env,
                                          pass_fds=(self._channel.fd,) if self._channel else ())
        finally:
            os.close(read_end)
        if self._channel is None:
            grow_pipe(self._fd)
        self.transport = transport
        self._num_steps = 0
        self._last_step = -1
        self._closed = False
        self.cpu_s = 0.0  # the writer process's CPU time (user + system), known once it closed the capture
        self.startup_cpu_s = 0.0  # of which its start-up, before the first record
        self._send(fp.HEADER, _ENCODER.encode(header))
        # the child reports whether it could create the file before we go on
        try:
            ready = self._answer()
        except CaptureError:
            self._end_pipe()
            raise
        self.startup_cpu_s = float(ready.get("cpu_s", 0.0))
        self.writer_pid = int(ready.get("pid", 0))  # the writer process (detached: no child of ours)
        if hasattr(os, "fork"):  # our own child forked the writer and exited (`detach`): reap it now, so no zombie
            try:                 # stays under the engine for the whole recording
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._channel is not None:
            self._channel.populate()

    # -- the CaptureWriter API ------------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, step: int) -> None:
        """Record a request arrival before step `step`."""
        self._send(fp.REQUEST_ADDED, _ENCODER.encode(fmt.RequestAdded(step, request)))

    def abort_request(self, request_id: str, step: int) -> None:
        """Record a client abort before step `step`."""
        self._send(fp.REQUEST_ABORTED, _ENCODER.encode(fmt.RequestAborted(step, request_id)))

    def trigger(self, why: str) -> None:
        """Something went wrong that a ring keeps a snapshot of (a request finished with an error); a plain capture
        has every step already, and ignores it."""
        self._send(fp.TROUBLE, why.encode())

    def write_step(self, index: int, scheduler_output: SchedulerOutput,
                   model_runner_output: ModelRunnerOutput | None, **extra: Any) -> int:
        """Record one step (see `CaptureWriter.write_step`); returns the bytes handed to the writer process."""
        return self.write_step_record(fmt.Step(index, scheduler_output, model_runner_output, **extra))

    def write_step_record(self, step: fmt.Step) -> int:
        """Record an already built `Step`."""
        self._check_order(step.index)
        try:
            data = _ENCODER.encode(step)
        except (TypeError, OverflowError, msgspec.EncodeError) as e:
            raise UsageError(f"cannot record a Step: {e}") from None
        self._send(fp.STEP, data)
        self._sent_step(step.index)
        return len(data)

    def write_crash(self, crash: fmt.Crash) -> None:
        """Record that the engine raised while executing step `crash.step` (then write that step, with no output)."""
        self._send(fp.CRASH, _ENCODER.encode(crash))

    def scheduled_image(self, index: int, scheduler_output: bytes, start_ns: int, schedule_ns: int) -> None:
        """Step `index` was scheduled: its SchedulerOutput image, kept by the writer process until the step ends."""
        self._send(*scheduled_frame(index, scheduler_output, start_ns, schedule_ns))

    def grammar_image(self, index: int, grammar_output: bytes) -> None:
        """Step `index`'s structured-output bitmask (GrammarOutput image), built before the model runs."""
        self._send(fp.GRAMMAR, _ENCODER.encode([index, msgspec.Raw(grammar_output)]))

    def output_image(self, index: int, model_runner_output: bytes | OutputParts, execute_ns: int,
                     update_ns: int) -> None:
        """Step `index` ended with this ModelRunnerOutput image (or the image in parts, logprob matrices apart):
        the writer process writes the step now."""
        self._check_order(index)
        self._send(*output_frame(index, model_runner_output, execute_ns, update_ns))
        self._sent_step(index)

    def crash_image(self, index: int, error_type: str, message: str, traceback: str) -> None:
        """Step `index` raised while executing: the writer process writes a Crash record and the scheduled step."""
        self._send(fp.STEP_FAILED, _ENCODER.encode([index, error_type, message, traceback]))
        self._last_step = max(self._last_step, index)

    def add_request_image(self, request_image: bytes, step: int) -> None:
        """Record an arrival given as another engine's msgpack-encoded request (converted in the child)."""
        self._send(fp.REQUEST_IMAGE, _ENCODER.encode([step, msgspec.Raw(request_image)]))

    def write_step_image(self, index: int, scheduler_output: bytes, model_runner_output: bytes | None,
                         grammar_output: bytes | None = None, timing: list[int] | None = None) -> int:
        """Record one step given as another engine's msgpack-encoded objects (converted in the child);
        `timing`: [start, schedule, execute, update] ns as `StepTiming`."""
        self._check_order(index)
        raw = [msgspec.Raw(b) if b is not None else None
               for b in (scheduler_output, model_runner_output, grammar_output)]
        data = _ENCODER.encode([index, *raw, timing])
        self._send(fp.STEP_IMAGE, data)
        self._sent_step(index)
        return len(data)

    def _check_order(self, index: int) -> None:
        """Refuse a step that does not follow the last one, as CaptureWriter does."""
        if index <= self._last_step:
            raise UsageError(f"step {index} written after step {self._last_step}: steps must increase")

    def _sent_step(self, index: int) -> None:
        self._last_step = index
        self._num_steps += 1

    def flush(self) -> None:
        """Ask the writer process to close its open chunk now."""
        self._send(fp.FLUSH, b"")

    def close(self, status: str = "ok") -> Path:
        """Footer, seek index, rename; waits for the writer process. Returns the final path."""
        if self._closed:
            return self.path
        self._closed = True
        try:
            self._send(fp.CLOSE, status.encode())
        finally:
            self._end_pipe()
        answer = self._answer()
        self._proc.wait()
        self._num_records = answer.get("records", 0)
        self.cpu_s = float(answer.get("cpu_s", 0.0))
        return self.path

    def abandon(self) -> None:
        """Stop without a footer: what was received stays in `NAME.partial` for `recover`."""
        if self._closed:
            return
        self._closed = True
        try:
            self._send(fp.QUIT, b"")
        except CaptureError:
            pass
        self._end_pipe()
        self._proc.wait()

    @property
    def num_steps(self) -> int:
        """Steps handed to the writer so far."""
        return self._num_steps

    @property
    def num_records(self) -> int:
        """Records in the closed capture (known after `close`)."""
        return getattr(self, "_num_records", 0)

    # -- plumbing -------------------------------------------------------------------------------------------------

    def _end_pipe(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._channel is not None:
            self._channel.release()
            if self._channel.fd >= 0:
                os.close(self._channel.fd)
                self._channel.fd = -1

    def _send(self, kind: bytes, *parts: bytes) -> None:
        try:
            if self._channel is not None:
                self._channel.send(kind, parts, sum(map(len, parts)))
                if kind in fp.WAKE_AT_ONCE:
                    self._channel.wake()
                return
            # one unbuffered write per record: nothing waits in our buffer if the engine crashes
            size = sum(map(len, parts))
            frame = [fp.FRAME_HEAD.pack(kind, size), *parts]
            done = os.writev(self._fd, frame) if hasattr(os, "writev") else 0
            if done < size + fp.FRAME_HEAD.size:  # (rare: a write cut short by a signal; or no writev)
                view = memoryview(b"".join(frame))[done:]
                while view:
                    view = view[os.write(self._fd, view):]
        except (OSError, ValueError, shm_channel.WriterGone):  # (BrokenPipeError is an OSError)
            answer = self._answer()
            raise CaptureError(self.partial_path, answer.get("error", "capture writer process died")) from None

    def _answer(self) -> dict:
        line = self._proc.stdout.readline()
        try:
            answer = json.loads(line) if line else {"error": f"capture writer process exited ({self._proc.wait()})"}
        except json.JSONDecodeError:
            answer = {"error": f"capture writer process said {line[:200]!r}"}
        if "error" in answer:
            self._closed = True
            raise CaptureError(self.partial_path, answer["error"])
        return answer
