"""zstd frame boundaries, read from the frame and block headers without decompressing anything.

python-zstandard does not expose ZSTD_findFrameCompressedSize, and we need more than it gives anyway: on a damaged
or truncated file we must know *why* a frame cannot be delimited, and resynchronise on the next frame magic.
Format reference: RFC 8878 §3.1.
"""

from __future__ import annotations

import mmap
import struct
from typing import NamedTuple

Buffer = bytes | bytearray | memoryview | mmap.mmap  # what frames are parsed from

ZSTD_MAGIC = 0xFD2FB528
ZSTD_MAGIC_BYTES = struct.pack("<I", ZSTD_MAGIC)
SKIPPABLE_MASK = 0xFFFFFFF0
SKIPPABLE_BASE = 0x184D2A50

_FCS_SIZES = (0, 2, 4, 8)
_DICT_ID_SIZES = (0, 1, 2, 4)
_MAX_BLOCK = 128 << 10  # Block_Maximum_Size: no valid block is larger


class FrameError(Exception):
    """A frame cannot be delimited at this offset; `reason` says why, `truncated` if the file simply ends."""

    def __init__(self, reason: str, *, truncated: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.truncated = truncated


class Frame(NamedTuple):
    """One frame's extent in the file."""

    start: int  # offset of its magic
    end: int  # offset just past it
    skippable_magic: int | None  # the magic of a skippable frame, None for a zstd data frame
    content_size: int | None  # declared decompressed size (data frames), None when not declared
    payload_start: int  # skippable frames: where the user data starts


def parse_frame(buf: Buffer, pos: int) -> Frame:
    """Delimit the frame starting at `pos` in `buf` (bytes, memoryview or mmap). Raises FrameError."""
    n = len(buf)
    if pos + 4 > n:
        raise FrameError("file ends inside a frame magic", truncated=True)
    (magic,) = struct.unpack_from("<I", buf, pos)
    if magic & SKIPPABLE_MASK == SKIPPABLE_BASE:
        if pos + 8 > n:
            raise FrameError("file ends inside a skippable frame header", truncated=True)
        (size,) = struct.unpack_from("<I", buf, pos + 4)
        end = pos + 8 + size
        if end > n:
            raise FrameError(f"skippable frame claims {size} bytes, file has {n - pos - 8}", truncated=True)
        return Frame(pos, end, magic, None, pos + 8)
    if magic != ZSTD_MAGIC:
        raise FrameError(f"no frame magic (found 0x{magic:08x})")
    p = pos + 4
    if p + 1 > n:
        raise FrameError("file ends inside a frame header", truncated=True)
    fhd = buf[p]
    fcs_flag, single_segment, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
    if fhd & 0x08:
        raise FrameError("reserved bit set in frame header")
    p += 1 + (0 if single_segment else 1) + _DICT_ID_SIZES[dict_flag]
    fcs_size = 1 if (fcs_flag == 0 and single_segment) else _FCS_SIZES[fcs_flag]
    if p + fcs_size > n:
        raise FrameError("file ends inside a frame header", truncated=True)
    content_size = None
    if fcs_size:
        content_size = int.from_bytes(bytes(buf[p : p + fcs_size]), "little") + (256 if fcs_size == 2 else 0)
    p += fcs_size
    while True:
        if p + 3 > n:
            raise FrameError("file ends inside a block header", truncated=True)
        bh = buf[p] | (buf[p + 1] << 8) | (buf[p + 2] << 16)
        last, btype, bsize = bh & 1, (bh >> 1) & 3, bh >> 3
        if btype == 3:
            raise FrameError("reserved block type")
        if bsize > _MAX_BLOCK:
            raise FrameError(f"block claims {bsize} bytes, over the format's maximum")
        p += 3 + (1 if btype == 1 else bsize)
        if p > n:
            raise FrameError("file ends inside a block", truncated=True)
        if last:
            break
    if checksum:
        p += 4
        if p > n:
            raise FrameError("file ends inside a frame checksum", truncated=True)
    return Frame(pos, p, None, content_size, pos + 4)


def skippable_frame(magic: int, payload: bytes) -> bytes:
    """Encode a skippable frame: stock zstd decoders skip it."""
    return struct.pack("<II", magic, len(payload)) + payload


def find_next_frame(buf: Buffer, start: int) -> int | None:
    """Offset of the next zstd data-frame magic at or after `start` (resynchronisation after damage)."""
    i = buf.find(ZSTD_MAGIC_BYTES, start)
    return None if i < 0 else i
