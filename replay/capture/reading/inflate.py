"""`ChunkInflater`: one chunk's frame of a mapped capture, decompressed and checksum-verified, on any thread.

A chunk is decompressed straight from the file's mapping (copying the frame out first cost 10-15 % of a full scan)
and its mapped pages are dropped right after, so a scan's resident memory stays flat. zstd contexts are not
thread-safe: each thread that decompresses (the read-ahead workers, `replay.capture.reading.read_ahead`) has its own.
"""

from __future__ import annotations

import io
import mmap
import threading
from pathlib import Path

import zstandard

from replay.capture.format.frames import FrameError, parse_frame
from replay.errors import LimitExceededError


class ChunkUnreadable(Exception):
    """A chunk's bytes cannot be read (bad frame, checksum, or content); the reason is the message."""


class ChunkInflater:
    """Decompresses chunk frames of `buf` (the capture's mapping) within the reader's frame limit."""

    def __init__(self, path: Path, buf: mmap.mmap | bytes, dctx: zstandard.ZstdDecompressor, max_frame_bytes: int):
        self.path = path
        self.max_frame_bytes = max_frame_bytes
        self._buf = buf
        self._local = threading.local()
        self._local.dctx = dctx  # the opening thread's context

    def inflate(self, start: int, end: int, number: int) -> bytes:
        """The bytes of chunk `number`, whose frame spans `start:end`. Raises ChunkUnreadable / LimitExceededError."""
        with memoryview(self._buf) as whole, whole[start:end] as frame:
            try:
                return self._inflate(frame, start, number)
            finally:
                self._release(start, end)

    def close(self) -> None:
        """Forget the mapping (the reader closes it): a later read finds no frame, as in an empty file."""
        self._buf = b""

    def _zstd(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "dctx", None)
        if d is None:
            d = self._local.dctx = zstandard.ZstdDecompressor(max_window_size=max(1 << 20, self.max_frame_bytes))
        return d

    def _inflate(self, frame: memoryview, offset: int, number: int) -> bytes:
        try:
            fr = parse_frame(frame, 0)
        except FrameError as e:
            raise ChunkUnreadable(e.reason) from None
        if fr.skippable_magic is not None or fr.end != len(frame):
            raise ChunkUnreadable("chunk frame boundaries do not match")
        if fr.content_size is not None and fr.content_size > self.max_frame_bytes:
            raise LimitExceededError(self.path, f"chunk claims {fr.content_size} bytes decompressed, over the "
                                     f"{self.max_frame_bytes}-byte limit", chunk=number, offset=offset)
        try:
            dctx = self._zstd()
            if fr.content_size is not None:
                data = dctx.decompress(frame)
            else:  # no declared size (not written by us): stream with a hard cap
                # (a copy: the stream reader would keep the mapping's view exported past its release)
                out, reader = io.BytesIO(), dctx.stream_reader(bytes(frame))
                while True:
                    piece = reader.read(1 << 20)
                    if not piece:
                        break
                    out.write(piece)
                    if out.tell() > self.max_frame_bytes:
                        raise LimitExceededError(self.path, f"chunk expands past the {self.max_frame_bytes}-byte limit",
                                                 chunk=number, offset=offset)
                data = out.getvalue()
        except zstandard.ZstdError as e:
            raise ChunkUnreadable(f"corrupt chunk ({e})") from None
        if len(data) > self.max_frame_bytes:
            raise LimitExceededError(self.path, "chunk expands past the limit", chunk=number, offset=offset)
        return data

    def _release(self, start: int, end: int) -> None:
        """Drop mapped pages we are done with (file-backed pages would otherwise count towards resident memory until
        the scan ends). A page shared with a neighbouring chunk that another thread is reading faults back in."""
        buf = self._buf
        if isinstance(buf, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
            page = mmap.PAGESIZE
            a = start - start % page
            if end > a:
                try:
                    buf.madvise(mmap.MADV_DONTNEED, a, min(end, len(buf)) - a)
                except (OSError, ValueError):  # advice only
                    pass
