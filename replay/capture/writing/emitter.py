"""`ChunkEmitter`: compress and write a writer's sealed chunks off the recording thread, in the order they were
sealed.

Why more than one thread: zstd and file writes run without the GIL, but a thread needs it back after each, and a
busy recording thread (the builtin engine's loop, which never blocks) gives it up only at the interpreter's switch
interval (5 ms), so one thread waits longer for the GIL than it compresses and falls chunks behind. Two threads wait
for the GIL at the same time, so their waits overlap; each compresses with its own context (a ZstdCompressor is not
thread-safe), and a frame is written once every chunk sealed before it is. Compiled threads and python-zstandard's
own multi-threaded compression were weighed against this: docs/performance.md, "The compiled modules".
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import zstandard

from replay.capture.format import records as fmt

WORKERS = 2
DEPTH = 8  # sealed chunks waiting at most: then the recording thread waits (back-pressure, not unbounded memory)
# Catching up, as `zstd --adapt` does: while this many sealed chunks wait behind the one a thread takes, the
# recorder is outrunning compression, and the thread compresses at `catch_up_level` instead (faster, a little
# larger: docs/performance.md, "Capture format"), so that the engine is not made to wait on the writer. An engine
# the writer keeps up with (vLLM's steps of milliseconds) never gets there: its capture is as small as `level` makes it.
CATCH_UP_BACKLOG = 2
CATCH_UP_LEVEL = 1


def open_emitter(f: Any, *, level: int, fsync: bool, interval: float, idle: Callable[[], tuple[int, Any] | None],
                 catch_up_level: int | None = CATCH_UP_LEVEL) -> ChunkEmitter:
    """The writer's emitter (see `ChunkEmitter`)."""
    return ChunkEmitter(f, level=level, fsync=fsync, interval=interval, idle=idle, catch_up_level=catch_up_level)


class _Frames:
    """The file `f`, the bytes in it, and the numbers of the chunks sealed."""

    def __init__(self, f: Any):
        self.f = f
        self._written = 0
        self._seq = 0  # the next chunk's number (given under the writer's lock)

    def write(self, data: bytes) -> None:
        """Write bytes directly: only before `start` or after `stop`, when no frame is being written."""
        self.f.write(data)
        self._written += len(data)

    def number(self) -> int:
        """The next sealed chunk's place in the file (call it under the lock that seals chunks)."""
        seq = self._seq
        self._seq += 1
        return seq


class ChunkEmitter(_Frames):
    """Background threads that turn sealed chunks (`.compress(cctx)`: their frame and raw size, `.info`: their
    ChunkInfo) into zstd frames in file `f`, in order. `idle()` is called by a thread that found nothing to do for
    `interval` seconds, and returns a chunk it sealed (numbered by `number()`) or None: an idle engine must not keep
    a chunk open forever. An error (a full disk) is kept in `error` for the recording thread; the threads go on
    draining."""

    def __init__(self, f: Any, *, level: int, fsync: bool, interval: float,
                 idle: Callable[[], tuple[int, Any] | None], workers: int | None = None,
                 catch_up_level: int | None = CATCH_UP_LEVEL):
        super().__init__(f)
        self.caught_up = 0  # chunks compressed at the catch-up level
        self._catch_up = catch_up_level if catch_up_level is not None and catch_up_level < level else None
        self._stops = 0  # the end-of-work markers in the queue: behind every chunk, so not a backlog
        self.chunks: list[fmt.ChunkInfo] = []  # of the frames written, in file order
        self.error: BaseException | None = None
        self._level, self._fsync, self._interval, self._idle = level, fsync, interval, idle
        self._queue: queue.Queue[tuple[int, Any] | None] = queue.Queue(maxsize=DEPTH)
        self._next = 0  # the number of the next frame to write
        self._ready: dict[int, tuple[Any, bytes, int]] = {}  # compressed, waiting for the chunks before them
        self._order = threading.Lock()  # held while frames are written: one writer, in order
        # uncompressed bytes of the chunks handed over, and of those written (and their frames' bytes)
        self._raw_handed = self._raw_out = self._frames_out = 0
        self._threads = [threading.Thread(target=self._run, name=f"replay-capture-writer-{i}", daemon=True)
                         for i in range(WORKERS if workers is None else workers)]

    def start(self) -> None:
        """Start the threads (after what the file starts with is written, `write`)."""
        for t in self._threads:
            t.start()

    @property
    def bytes_written(self) -> int:
        """Bytes in the file so far (frames written, not those still being compressed)."""
        return self._written

    @property
    def bytes_due(self) -> int:
        """Bytes the file will hold once the chunks handed over are written: those written, and the rest at the
        ratio the written ones compressed at (a third before any). Under load the threads fall up to DEPTH chunks
        behind, which `bytes_written` does not show."""
        pending = self._raw_handed - self._raw_out
        ratio = self._frames_out / self._raw_out if self._raw_out else 1 / 3
        return self._written + int(max(pending, 0) * min(ratio, 1.0))

    def put(self, chunk: Any) -> None:
        """Hand a sealed chunk over (call it under the lock that seals chunks, so numbers follow the seals).
        Blocks while DEPTH chunks wait."""
        self._handed(chunk)
        self._queue.put((self.number(), chunk))

    def _handed(self, chunk: Any) -> None:
        self._raw_handed += getattr(chunk, "raw", 0) or chunk.info.raw_size

    def stop(self) -> None:
        """Write every chunk handed over, then end the threads."""
        self._stops = len(self._threads)
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        cctx = zstandard.ZstdCompressor(level=self._level, write_checksum=True, write_content_size=True)
        fast = None if self._catch_up is None else \
            zstandard.ZstdCompressor(level=self._catch_up, write_checksum=True, write_content_size=True)
        while True:
            try:
                item = self._queue.get(timeout=self._interval)
            except queue.Empty:
                try:
                    item = self._idle()
                except Exception as e:  # noqa: BLE001 - handed to the recording thread; this one goes on
                    self.error = e
                    continue
                if item is None:
                    continue
                self._handed(item[1])
            if item is None:
                return
            if self.error is None:  # (after an error it keeps draining, so producers never block on a dead writer)
                behind = fast is not None and self._queue.qsize() - self._stops >= CATCH_UP_BACKLOG
                self._emit(fast if behind else cctx, *item, behind)

    def _emit(self, cctx: zstandard.ZstdCompressor, seq: int, c: Any, behind: bool = False) -> None:
        """Compress chunk `seq`, then write every frame that is next in order."""
        try:
            frame, raw = c.compress(cctx)
            with self._order:
                self.caught_up += behind
                self._ready[seq] = (c, frame, raw)
                while self._next in self._ready and self.error is None:
                    c, frame, raw = self._ready.pop(self._next)
                    c.info.offset = self.bytes_written
                    c.info.length = len(frame)
                    c.info.raw_size = raw
                    self.write(frame)
                    self._raw_out += getattr(c, "raw", 0) or raw
                    self._frames_out += len(frame)
                    self.f.flush()
                    if self._fsync:
                        os.fsync(self.f.fileno())
                    self.chunks.append(c.info)
                    self._next += 1
        except BaseException as e:  # noqa: BLE001 - handed to the recording thread (CaptureWriter._check)
            self.error = e
