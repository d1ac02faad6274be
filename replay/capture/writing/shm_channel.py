"""A shared-memory channel for the engine thread's frames to the writer process, in place of writing them into its pipe.

A frame written into a pipe costs the engine thread a system call and, when the writer process sleeps in `read`, a
wake-up of it; copying the same bytes into shared memory costs a fraction of that (docs/performance.md, "The real
vLLM tap"). The pipe stays, for what shared memory cannot say: the
engine writes a byte into it to wake the writer process (a full buffer, a flush, the close), and its end (the engine
went away, however) is what tells the writer process to seal.

The shared file (a memfd: nothing to clean up, whoever dies): a control page of CONTROL bytes, then the
circular buffer (a power of two of bytes). In the control page:
  0    written   u64  bytes the engine has finished writing, counted from the start (never wraps)
  64   reserved  u64  where the frame the engine is copying now ends (> written while it copies)
  128  consumed  u64  bytes the writer process has taken out (the engine may reuse them)
  192  failed    u64  non-zero once the writer process stopped with an error (its stdout says which)
Each counter has a cache line of its own, so neither side's stores evict the other's. Frames are the pipe's,
`kind (1 byte) + length (u32 LE) + payload`, each padded to 8 bytes; a frame never wraps: where the buffer's tail is
too short for it, a wrap frame (kind 0) fills the tail. A frame longer than a quarter of the buffer goes in pieces
(kind 1) that the reader joins. A frame counts once `written` passes it, so a frame the engine was copying when it
died is dropped, and said to be (`reserved` > `written`), as a frame cut short in the pipe is.

The cursors are plain 8-byte aligned stores and loads (ctypes): ordered on x86-64 (total store order, a load is never
reordered with an older load), not on weaker memory models without fences Python cannot issue, so the channel is used
on x86-64 only and the pipe elsewhere (`available`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import select
import time
from collections.abc import Sequence

from replay.capture.writing.frame_protocol import FRAME_HEAD, PIECE, WRAP

HEAD = FRAME_HEAD
CONTROL = 4096
DEFAULT_CHANNEL_BYTES = 8 << 20  # hundreds of 64-request vLLM steps: a burst never makes the engine wait
_WRITTEN, _RESERVED, _CONSUMED, _FAILED = 0, 64, 128, 192
_WAKE = b"\0"


def available() -> bool:
    """Whether this machine can use the channel (Linux memfd, x86-64's store ordering)."""
    return hasattr(os, "memfd_create") and platform.machine().lower() in ("x86_64", "amd64")


def _padded(n: int) -> int:
    return (HEAD.size + n + 7) & ~7


class WriterGone(Exception):
    """The writer process stopped (an error it reported, or its end of the pipe closed)."""


def _check_size(size: int) -> None:
    if size & (size - 1) or size < 4096:
        raise ValueError(f"channel size {size}: a power of two of at least 4096 bytes")


class _Shared:
    """The shared file mapped, with its four counters as ctypes views."""

    def __init__(self, fd: int, size: int, populate: bool = False):
        _check_size(size)
        self.size, self.mask = size, size - 1
        self._map(fd, populate)

    def _map(self, fd: int, populate: bool) -> None:
        # MAP_POPULATE: every page in now, not one fault per 4 KiB on the first lap (2.7 ms per MiB where the pages
        # are new, zeroed by the kernel; 0.1 ms per MiB where the other side's mapping already made them)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self.mm = mmap.mmap(fd, CONTROL + self.size, flags=flags)
        self.written, self.reserved, self.consumed, self.failed = (
            ctypes.c_uint64.from_buffer(self.mm, off) for off in (_WRITTEN, _RESERVED, _CONSUMED, _FAILED))

    def release(self) -> None:
        """Unmap (the ctypes views go first: a mapping with views into it cannot be closed)."""
        self.written = self.reserved = self.consumed = self.failed = None
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass  # a view still held somewhere: the mapping goes with the process


class ChannelSender(_Shared):
    """The engine side: copies frames into the buffer; one thread sends (vLLM's engine core loop)."""

    LIVENESS_EVERY = 256  # sends between two checks that the writer process still reads (a byte into its pipe)

    def __init__(self, wake_fd: int, size: int = DEFAULT_CHANNEL_BYTES):
        _check_size(size)
        self.fd = os.memfd_create("replay-capture-channel", getattr(os, "MFD_CLOEXEC", 1))
        os.ftruncate(self.fd, CONTROL + size)
        super().__init__(self.fd, size)
        self.wake_fd = wake_fd
        os.set_blocking(wake_fd, False)  # a pipe already full of wake-ups needs no more (and must not block us)
        self.w = 0  # our copy of `written`
        self.sends = 0
        self.waits = 0  # times the buffer was full and the engine waited for room

    def populate(self) -> None:
        """Map the buffer again, every page in: called once the writer process (which maps it populated, zeroing
        the pages on its own CPU) is ready, so that the engine thread takes no page fault on the buffer's first lap.
        Then our copy of the memfd goes (the mapping stays)."""
        old = self.mm
        self._map(self.fd, populate=True)  # (the old views are dropped with the names rebound)
        old.close()
        os.close(self.fd)
        self.fd = -1

    def send(self, kind: bytes, parts: Sequence[bytes], n: int) -> None:
        """Copy one frame (`n` payload bytes in `parts`) into the buffer, waiting for room if it is full."""
        need = _padded(n)
        if need > self.size >> 2:
            return self._pieces(HEAD.pack(kind, n) + b"".join(parts))
        w = self.w
        off = w & self.mask
        if need > self.size - off:  # no frame wraps: fill the tail, go on at the start
            tail = self.size - off
            self._room(w, tail)
            HEAD.pack_into(self.mm, CONTROL + off, WRAP, tail - HEAD.size)
            w += tail
            self.written.value = w
            off = 0
        if self.size - (w - self.consumed.value) < need:
            self._room(w, need)
        self.reserved.value = w + need
        mm = self.mm
        p = CONTROL + off
        HEAD.pack_into(mm, p, kind, n)
        p += HEAD.size
        for part in parts:
            q = p + len(part)
            mm[p:q] = part
            p = q
        self.w = w + need
        self.written.value = self.w
        self.sends += 1
        if self.failed.value or not self.sends % self.LIVENESS_EVERY:
            self.wake()

    def _pieces(self, frame: bytes) -> None:
        step = self.size >> 3
        for i in range(0, len(frame), step):
            piece = frame[i:i + step]
            self.send(PIECE, (piece,), len(piece))

    def _room(self, w: int, need: int) -> None:
        """Wait until the writer process has taken out enough to fit `need` bytes at `w`."""
        if self.size - (w - self.consumed.value) >= need:
            return
        self.waits += 1
        pause = 0.0002
        while self.size - (w - self.consumed.value) < need:
            self.wake()  # it may sleep between polls; and a closed pipe says it is gone
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def wake(self) -> None:
        """Wake the writer process; raises `WriterGone` if it stopped."""
        if self.failed.value:
            raise WriterGone("the writer process stopped")
        try:
            os.write(self.wake_fd, _WAKE)
        except BlockingIOError:  # full of wake-ups it has not read yet: it will
            pass
        except OSError:  # EPIPE: nobody reads the pipe any more
            raise WriterGone("the writer process is gone") from None


class ChannelReader(_Shared):
    """The writer process's side: `next()` as `FrameReader`'s, frames copied out of the buffer (bytes of their own,
    so the buffer's room is given back at once). Between polls it waits on the pipe, which the engine writes a byte
    into when it wants it now, and which ends when the engine goes away. While frames keep coming it polls every
    `gulp_s` (one wake-up per `gulp_s`, as `FrameReader`); an idle engine lets it back off to `idle_s`."""

    def __init__(self, fd: int, size: int, wake_fd: int, gulp_s: float = 0.02, idle_s: float = 0.25):
        super().__init__(fd, size, populate=True)
        os.close(fd)
        self.wake_fd = wake_fd
        self.gulp_s, self.idle_s = gulp_s, idle_s
        self.r = 0
        self._seen = 0  # `written` as last read
        self._pieces: list[bytes] = []
        self._eof = False
        self._timeout = gulp_s

    def fail(self) -> None:
        """Tell the engine this process stopped with an error (before it says which on stdout)."""
        self.failed.value = 1

    def next(self) -> tuple[bytes | None, bytes | memoryview | None]:
        """The next frame, waiting for it: (kind, payload); (None, b"") once the engine went away after a whole
        frame, (None, None) when it went away inside one."""
        mm = self.mm
        while True:
            r = self.r
            if r == self._seen:
                self._seen = self.written.value
                if r == self._seen:
                    if self._eof:
                        cut = self.reserved.value > self._seen or self._pieces
                        return None, (None if cut else b"")
                    self._wait()
                    continue
                self._timeout = self.gulp_s
            off = CONTROL + (r & self.mask)
            kind, n = HEAD.unpack_from(mm, off)
            self.r = r + _padded(n)
            if kind == WRAP:
                self.consumed.value = self.r
                continue
            payload = mm[off + HEAD.size:off + HEAD.size + n]  # a copy: the room is free once `consumed` says so
            self.consumed.value = self.r
            if kind != PIECE:
                return kind, payload
            self._pieces.append(payload)
            total = sum(map(len, self._pieces))
            if total >= HEAD.size and total >= HEAD.size + HEAD.unpack_from(self._pieces[0])[1]:
                frame = b"".join(self._pieces)
                self._pieces = []
                return frame[:1], memoryview(frame)[HEAD.size:]

    def _wait(self) -> None:
        """Sleep until the next poll, a wake-up byte, or the end of the pipe."""
        ready, _, _ = select.select([self.wake_fd], [], [], self._timeout)
        if ready:
            if not os.read(self.wake_fd, 1 << 16):
                self._eof = True
            return
        self._timeout = min(self._timeout * 2, self.idle_s)  # nothing came: an idle engine costs fewer wake-ups
