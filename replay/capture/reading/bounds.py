"""Where a capture's records lie: its prologue (signature and format version) and its seek index (the chunk table
at the end of a sealed capture), each checked before it is trusted.

A capture that was never sealed (a crash) has no index and is read by a linear scan of its frames; an index that
fails any check is reported as damage and read the same way.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from pathlib import Path

import msgspec
import zstandard

from replay.capture.format import records as fmt
from replay.capture.format.frames import ZSTD_MAGIC, FrameError, parse_frame
from replay.capture.reading.damage import Damage
from replay.errors import NotACaptureError, UnsupportedVersionError


def read_prologue(path: Path, buf: mmap.mmap | bytes) -> tuple[tuple[int, int], int]:
    """((major, minor) format version, the offset where the prologue's frame ends); a file that is no capture, or
    one of a newer major format, is refused in one line."""
    try:
        fr = parse_frame(buf, 0)
    except FrameError:
        fr = None
    body = bytes(buf[8:20]) if fr is not None and fr.skippable_magic == fmt.PROLOGUE_MAGIC and fr.end >= 20 else b""
    if not body.startswith(fmt.PROLOGUE_ID):
        zstd = len(buf) >= 4 and struct.unpack_from("<I", buf, 0)[0] == ZSTD_MAGIC
        what = "a plain zstd file" if zstd else "no capture signature"
        raise NotACaptureError(path, f"not a replay capture ({what})")
    major, minor = struct.unpack_from("<HH", body, 8)
    if major > fmt.FORMAT_MAJOR:
        raise UnsupportedVersionError(
            path, f"written in capture format {major}.{minor}; this replay reads format "
            f"{fmt.FORMAT_MAJOR}.x and older: upgrade replay to read it")
    return (major, minor), fr.end


def load_index(buf: mmap.mmap | bytes, size: int, prologue_end: int,
               dctx: zstandard.ZstdDecompressor) -> tuple[fmt.Index | None, list[Damage]]:
    """(the seek index, or None where there is none or it fails a check; the damage that check found). `size`: the
    file's; `prologue_end`: where its first chunk starts."""
    tlen = 4 + 8 + len(fmt.INDEX_TRAILER_ID)
    trailer = bytes(buf[size - 8:size]) if size >= 8 else b""
    if size < prologue_end + 8 + tlen or trailer not in (fmt.INDEX_TRAILER_ID, fmt.INDEX_TRAILER_ZSTD):
        return None, []  # no index: an unfinished capture (crash), read by linear scan
    crc, offset = struct.unpack_from("<IQ", buf, size - tlen)
    try:
        if offset >= size:
            raise ValueError("index offset past the end of the file")
        fr = parse_frame(buf, offset)
        if fr.skippable_magic != fmt.INDEX_MAGIC or fr.end != size:
            raise ValueError("index frame not where the trailer says")
        body = buf[fr.payload_start:size - tlen]
        if len(body) > fmt.MAX_INDEX_BYTES:
            raise ValueError("index larger than the limit")
        if zlib.crc32(body) != crc:
            raise ValueError("index checksum mismatch")
        if trailer == fmt.INDEX_TRAILER_ZSTD:  # format 1.3: compressed
            body = dctx.decompress(bytes(body), max_output_size=fmt.MAX_INDEX_BYTES)
        index = fmt.INDEX_DECODER.decode(body)
        prev_end = prologue_end
        for c in index.chunks:  # chunks must tile the file from the prologue to the index
            if c.offset != prev_end or c.length <= 0:
                raise ValueError("index chunk table does not match the file")
            prev_end = c.offset + c.length
        if prev_end != offset:
            raise ValueError("index chunk table does not reach the index")
    except (ValueError, FrameError, msgspec.DecodeError, zstandard.ZstdError) as e:
        return None, [Damage("index", f"seek index unreadable ({e}); read by linear scan", offset=int(offset))]
    return index, []
