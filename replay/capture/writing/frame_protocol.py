"""The frames the engine side sends the writer process (`writer_process`), through its pipe or the shared-memory
channel (`shm_channel`): `kind (1 byte) + length (u32 LE) + payload`. Both sides import their kinds from here; the
table is in docs/capture-format.md ("The writer's frames").

Payloads are msgpack. Records go with string ids, as `CaptureWriter` takes them; images are another engine's objects
msgpack-encoded as they are (all the engine thread pays for), which the writer process stores as they are
(`StepImage`) or converts (`replay.contracts.image_decoder`).
"""

from __future__ import annotations

import os
import struct
import time

FRAME_HEAD = struct.Struct("<cI")  # kind (1 byte), payload length (u32 LE)

# -- records, as CaptureWriter takes them -------------------------------------------------------------------------
HEADER = b"H"  # the capture's Header; the writer process answers "ready" once it could create the file
REQUEST_ADDED = b"A"  # a RequestAdded record
REQUEST_ABORTED = b"X"  # a RequestAborted record
STEP = b"S"  # a whole Step record
CRASH = b"K"  # a Crash record: the engine raised in a step (the step itself follows as a STEP)

# -- another engine's images, a step in the order the engine lives it (a step that never completes is still known) --
REQUEST_IMAGE = b"R"  # an arrival: [step, request image]
SCHEDULED = b"P"  # a step was scheduled: [index, scheduler_output image, start_ns, schedule_ns]
GRAMMAR = b"G"  # its structured-output bitmask: [index, grammar_output image]
OUTPUT = b"O"  # it ended: [index, model_runner_output image, execute_ns, update_ns] (the step is written then)
OUTPUT_PARTS = b"L"  # the same with the output in parts (`OutputParts`: its logprob matrices apart, moved undecoded)
STEP_FAILED = b"E"  # it raised: [index, error_type, message, traceback] (a Crash record and the scheduled step)
STEP_IMAGE = b"V"  # a whole step: [index, scheduler_output, model_runner_output, grammar_output, timing]

# -- control ------------------------------------------------------------------------------------------------------
TROUBLE = b"T"  # something a ring keeps a snapshot of (text; a plain capture ignores it)
FLUSH = b"F"  # close the open chunk now (empty)
CLOSE = b"C"  # footer, index, rename (payload: the footer status); the writer process answers "closed"
QUIT = b"Q"  # abandon: no footer, what was received stays in NAME.partial (empty)

# -- the shared-memory channel's own, never seen past it ----------------------------------------------------------
WRAP = b"\0"  # fills the buffer's tail where the next frame does not fit
PIECE = b"\1"  # a piece of a frame longer than a quarter of the buffer

IMAGE_FRAMES = frozenset((STEP_IMAGE, REQUEST_IMAGE, SCHEDULED, GRAMMAR, OUTPUT, OUTPUT_PARTS, STEP_FAILED))
WAKE_AT_ONCE = frozenset((HEADER, FLUSH, CLOSE, QUIT))  # through the channel, the others wait for the next poll


class FrameReader:
    """Frames from a pipe, read in gulps. Waking on every frame cost the writer process more CPU than handling them
    (docs/performance.md), so after a small read it lets frames gather for `gulp_s` before reading again: one
    wake-up per `gulp_s` at most, in exchange for that much latency. A burst (a read of `GULP_BYTES` or more) is
    read on at once, so a fast engine never waits on a full pipe."""

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
