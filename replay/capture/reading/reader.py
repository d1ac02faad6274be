"""`CaptureReader`: iterate records, jump to step N through the index, survive damage.

Robustness contract (after MCAP's reader): only `replay.errors` exceptions escape; unknown record tags are
skipped; a missing or damaged index falls back to a linear frame scan; a damaged chunk is reported (with its
number and byte offset) and reading goes on with the next one; nothing is ever allocated on a size the file merely
claims beyond the configured limits.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import msgspec
import zstandard

from replay.capture.codec.columns import ColumnSource
from replay.capture.codec.step_image import image_as_sent, step_from_image
from replay.capture.codec.stepcodec import step_from_wire
from replay.capture.format import records as fmt
from replay.capture.format.frames import (
    SKIPPABLE_BASE,
    SKIPPABLE_MASK,
    ZSTD_MAGIC,
    FrameError,
    find_next_frame,
    parse_frame,
)
from replay.capture.format.ids import IdTable, UnknownHandleError
from replay.capture.format.peek import is_unknown_tag, peek
from replay.capture.reading.bounds import load_index, read_prologue
from replay.capture.reading.damage import Damage
from replay.capture.reading.inflate import ChunkInflater, ChunkUnreadable
from replay.capture.reading.liveness import unfinished
from replay.capture.reading.read_ahead import ReadAhead, default_workers
from replay.errors import (
    CaptureDamagedError,
    CaptureError,
    HeaderLostError,
    LimitExceededError,
    NotACaptureError,
    UnsupportedVersionError,
)


class ChunkRef(NamedTuple):
    """A chunk's place in the file, with its index entry when the index is readable."""

    number: int
    offset: int
    end: int
    info: fmt.ChunkInfo | None


_ONE_AT_A_TIME = ReadAhead(0)  # (no threads: nothing to close)


class CaptureReader:
    """Reads a capture file. Use as a context manager; `header` is read on open."""

    def __init__(self, path: str | os.PathLike, *, max_frame_bytes: int = fmt.MAX_FRAME_BYTES,
                 max_record_bytes: int = fmt.MAX_RECORD_BYTES, read_ahead: int | None = None):
        """`read_ahead`: worker threads that decompress chunks ahead of a walk over many of them (`records()`,
        `chunk_bytes()`); None picks by the machine's cores, 0 decompresses every chunk on the caller's thread."""
        self.path = Path(path)
        self.max_frame_bytes = max_frame_bytes
        self.max_record_bytes = max_record_bytes
        self.damage: list[Damage] = []
        self.unknown_records = 0  # records with tags this version does not know (skipped)
        self.footer: fmt.Footer | None = None
        self._images = None  # ImageDecoder for StepImage records
        self._dctx = zstandard.ZstdDecompressor(max_window_size=max(1 << 20, max_frame_bytes))
        self._ahead = ReadAhead(default_workers() if read_ahead is None else read_ahead)
        self._file = None
        self._buf: mmap.mmap | bytes = b""
        self._inflater: ChunkInflater | None = None  # made once the file is mapped
        self._open()
        try:
            self.format_version, self._prologue_end = read_prologue(self.path, self._buf)
            self.index, damage = load_index(self._buf, self.file_size, self._prologue_end, self._dctx)
            self.damage += damage
            self.header = self._read_header()
        except BaseException:
            self.close()
            raise

    # -- opening -------------------------------------------------------------------------------------------------

    def _open(self) -> None:
        p = self.path
        try:
            if p.is_dir():
                ring = (p / "writer.json").exists() or any(p.glob("segment-*.capture"))
                raise NotACaptureError(p, "is a ring's directory, not a capture file: `replay snapshot` (from Python "
                                          "request_snapshot) seals its window into one" if ring else
                                       "is a directory, not a capture file")
            self._file = open(p, "rb")
            size = os.fstat(self._file.fileno()).st_size
        except NotACaptureError:
            raise
        except FileNotFoundError:
            partial = p.with_name(p.name + ".partial")
            raise NotACaptureError(p, "no such file" + (f" ({partial.name} is there: still being written, or cut "
                                                       "short; `replay info` reads it)" if partial.exists() else "")
                                   ) from None
        except OSError as e:
            raise NotACaptureError(p, f"cannot open: {e.strerror or e}") from None
        if size == 0:
            raise NotACaptureError(p, "empty file, not a capture")
        self.file_size = size
        self._buf = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self._inflater = ChunkInflater(self.path, self._buf, self._dctx, self.max_frame_bytes)

    def _read_header(self) -> fmt.Header:
        ref = next(self.iter_chunks(), None)
        if ref is None:
            raise HeaderLostError(self.path, "truncated before its header: nothing to read")
        try:
            recs = self._decode_chunk(ref)
        except (ChunkUnreadable, LimitExceededError) as e:
            raise HeaderLostError(self.path, f"header chunk unreadable: {getattr(e, 'reason', e)}") from None
        if not recs or not isinstance(recs[0], fmt.Header):
            raise HeaderLostError(self.path, "first record is not a header")
        header = recs[0]
        if tuple(header.format_version)[0] > fmt.FORMAT_MAJOR:
            raise UnsupportedVersionError(self.path, f"header says capture format {header.format_version[0]}."
                                          f"{header.format_version[1]}; this replay reads {fmt.FORMAT_MAJOR}.x")
        return header

    # -- chunks ---------------------------------------------------------------------------------------------------

    def iter_chunks(self) -> Iterator[ChunkRef]:
        """Every chunk in file order: from the index, or found by a linear frame scan (damage recorded)."""
        if self.index is not None:
            for i, c in enumerate(self.index.chunks):
                yield ChunkRef(i, c.offset, c.offset + c.length, c)
            return
        buf, n, pos, k = self._buf, self.file_size, self._prologue_end, 0
        while pos < n:
            try:
                fr = parse_frame(buf, pos)
            except FrameError as e:
                if e.truncated:
                    self._add_damage(Damage("truncated", f"file ends inside chunk {k} ({e.reason})", chunk=k,
                                            offset=pos))
                    return
                nxt = find_next_frame(buf, pos + 1)
                self._add_damage(Damage("garbage", f"unreadable bytes ({e.reason})", chunk=k, offset=pos))
                if nxt is None:
                    return
                pos = nxt
                continue
            if fr.skippable_magic is not None:
                if fr.skippable_magic == fmt.INDEX_MAGIC:
                    return
                pos = fr.end
                continue
            yield ChunkRef(k, fr.start, fr.end, None)
            k += 1
            # Trust the frame's end only if another frame (or the end of file) starts there; a bit flip in a block
            # header makes it point into the middle of the next chunk.
            if fr.end < n and not self._frame_starts_at(fr.end):
                nxt = find_next_frame(buf, fr.start + 4)
                pos = n if nxt is None else nxt
                if pos > fr.end:  # bytes past that frame that start no frame: a lost chunk, never skipped silently
                    self._add_damage(Damage("garbage", "unreadable bytes (no frame magic where a frame ends)",
                                            chunk=k, offset=fr.end))
            else:
                pos = fr.end

    def _frame_starts_at(self, pos: int) -> bool:
        if pos + 4 > self.file_size:
            return False
        (magic,) = struct.unpack_from("<I", self._buf, pos)
        return magic == ZSTD_MAGIC or magic & SKIPPABLE_MASK == SKIPPABLE_BASE

    def frame(self, ref: ChunkRef) -> bytes:
        """One chunk's zstd frame as stored (compressed, unchecked: `chunk_bytes` verifies it)."""
        return bytes(self._buf[ref.offset:ref.end])

    def read_chunk_bytes(self, ref: ChunkRef) -> bytes:
        """Decompress one chunk, verifying its checksum. Raises CaptureDamagedError / LimitExceededError."""
        try:
            return self._decompress(ref)
        except ChunkUnreadable as e:
            raise CaptureDamagedError(self.path, str(e), chunk=ref.number, offset=ref.offset) from None

    def chunk_bytes(self, chunks: Iterable[ChunkRef] | None = None
                    ) -> Iterator[tuple[ChunkRef, bytes | None, CaptureError | None]]:
        """(chunk, its decompressed and checksum-verified bytes, None) for every chunk in file order (or those of
        `chunks`), decompressed ahead on worker threads; (chunk, None, error) for one that cannot be read
        (CaptureDamagedError, LimitExceededError): what a whole-capture scan uses."""
        for ref, data, e in self._walker().map(self._decompress, self.iter_chunks() if chunks is None else chunks,
                                               (ChunkUnreadable, LimitExceededError)):
            if isinstance(e, ChunkUnreadable):
                e = CaptureDamagedError(self.path, str(e), chunk=ref.number, offset=ref.offset)
            yield ref, data, e

    def _walker(self) -> ReadAhead:
        """How a walk over many chunks decompresses them: ahead, with the index; without it, one at a time, as the
        linear scan finds them, so its damage is reported in the order it is met."""
        return self._ahead if self.index is not None else _ONE_AT_A_TIME

    def _decompress(self, ref: ChunkRef) -> bytes:
        """One chunk's bytes (any thread). Raises ChunkUnreadable / LimitExceededError."""
        return self._inflater.inflate(ref.offset, ref.end, ref.number)

    def _decode_chunk(self, ref: ChunkRef, keep_step=None, data: bytes | None = None) -> list:
        """Wire records of one chunk (unknown tags skipped; `data`: its bytes, if already decompressed). Raises
        ChunkUnreadable.

        With an index that holds the ids (before 1.5), `Ids` records are skipped (handles resolve from it); with any
        index `keep_step(index) -> bool`,
        when given, selects steps by their index *before* decoding them: random access decodes one record."""
        if data is None:
            data = self._decompress(ref)
        try:
            raws = fmt.CHUNK_DECODER.decode(data)
        except msgspec.DecodeError as e:
            raise ChunkUnreadable(f"chunk content is not a record list ({e})") from None
        out = []
        for raw in raws:
            if len(raw) > self.max_record_bytes:
                raise LimitExceededError(self.path, f"record of {len(raw)} bytes over the {self.max_record_bytes}-byte "
                                         "limit", chunk=ref.number, offset=ref.offset)
            if self.index is not None:  # before 1.5 handles come from the index: skip the in-band declarations
                tag, index = peek(raw)
                if (tag == "ids" and self.index.ids) or (keep_step is not None and tag in fmt.STEP_TAGS
                                                         and index is not None
                                    and not keep_step(index)):
                    continue
            try:
                out.append(fmt.WIRE_DECODER.decode(raw))
            except msgspec.DecodeError as e:
                if is_unknown_tag(raw):
                    self.unknown_records += 1
                    continue
                # framed, and its chunk's checksum held, but not of its record's types (a writer that stored a
                # float in an int list): that record alone is lost, not the chunk's others
                tag, index = peek(raw)
                step = index if tag in fmt.STEP_TAGS else None
                self._add_damage(Damage("record", f"a malformed {tag or 'untagged'} record ({e})", chunk=ref.number,
                                        offset=ref.offset, first_step=step, last_step=step))
        return out

    # -- records --------------------------------------------------------------------------------------------------

    def records(self, *, chunks: Iterator[ChunkRef] | None = None, keep_step: Callable[[int], bool] | None = None,
                images: bool = False) -> Iterator[fmt.Record | fmt.StepImage]:
        """Every readable record in order, request ids resolved; damage is recorded in `self.damage`.

        `chunks` restricts reading to some chunks, `keep_step(index)` to some steps (both need the index); `images`:
        image steps come as `StepImage`s, output whole (every field sent: what `recover` copies), if they convert."""
        table = IdTable(self.index.ids) if self.index is not None else IdTable()
        # from 1.5 a chunk declares every handle it uses: each starts afresh, so one that does not is damage
        own = self.format_version >= (1, 5) and not table.ids
        if self.index is None:
            keep_step = None  # handles are declared in-band: every Ids record must be read
        saw_footer = False
        for ref, data, err in self.chunk_bytes(chunks):
            if own:
                table = IdTable()
            if err is None:
                try:
                    recs = self._decode_chunk(ref, keep_step, data)
                except (ChunkUnreadable, LimitExceededError) as e:
                    err = e
            if err is not None:
                self._add_damage(Damage.chunk_lost(ref.number, ref.offset, ref.info, getattr(err, "reason", str(err))))
                continue
            columns = None  # a chunk's steps refer to their own chunk's logprob columns only
            for rec in recs:
                if isinstance(rec, fmt.Ids):
                    table.declare(rec)
                elif isinstance(rec, fmt.LiveIds):
                    table.declare_live(rec)
                elif isinstance(rec, fmt.LogprobColumns):
                    columns = ColumnSource(rec)
                elif isinstance(rec, (fmt.Step, fmt.StepImage)):
                    try:
                        step = step_from_wire(rec, table, columns) if isinstance(rec, fmt.Step) else \
                            step_from_image(rec, self._image_decoder(), columns)  # (its damage is found here)
                        yield image_as_sent(rec, columns) if images and isinstance(rec, fmt.StepImage) else step
                    except Exception as e:  # noqa: BLE001 - any inconsistency in stored data is damage, not a crash
                        why = ("refers to request ids no readable record declares" if isinstance(e, UnknownHandleError)
                               else f"has inconsistent contents ({type(e).__name__}: {e})")
                        self._add_damage(Damage("record", f"step {rec.index} {why}", chunk=ref.number,
                                                offset=ref.offset, first_step=rec.index, last_step=rec.index))
                else:
                    if isinstance(rec, fmt.Footer):
                        self.footer = rec
                        saw_footer = True
                    yield rec
        if chunks is None and not saw_footer and self.index is None:
            self._add_damage(unfinished(self.path, "; `replay recover` rewrites it with an index"))

    def _image_decoder(self):
        """The converter of this capture's image steps (made on first use: most captures have none)."""
        if self._images is None:
            from replay.contracts.image_decoder import ImageDecoder

            self._images = ImageDecoder()
        return self._images

    def steps(self, first: int | None = None, last: int | None = None) -> Iterator[fmt.Step]:
        """Steps with `first <= index <= last` (either bound optional), reading only the chunks that hold them
        when the index is present."""
        chunks = None
        if self.index is not None and (first is not None or last is not None):
            lo = -1 if first is None else first
            hi = float("inf") if last is None else last
            chunks = iter([ChunkRef(i, c.offset, c.offset + c.length, c) for i, c in enumerate(self.index.chunks)
                           if c.num_steps and c.last_step >= lo and c.first_step <= hi])
        lo = -1 if first is None else first
        hi = float("inf") if last is None else last
        for rec in self.records(chunks=chunks, keep_step=lambda i: lo <= i <= hi):
            if isinstance(rec, fmt.Step) and lo <= rec.index <= hi:
                yield rec

    def step(self, n: int) -> fmt.Step:
        """Step `n`; with an index this decompresses exactly one chunk. Raises CaptureError if absent."""
        for s in self.steps(n, n):
            return s
        lost = [d for d in self.damage if d.first_step is not None and d.first_step <= n <= (d.last_step or n)]
        if lost:
            raise CaptureDamagedError(self.path, f"step {n} is in a damaged part of the capture: {lost[0].describe()}")
        raise CaptureError(self.path, f"no step {n} in this capture")

    def step_span(self) -> tuple[int, int] | None:
        """(first, last) step index by the seek index; None without an index or without steps."""
        if self.index is None:
            return None
        chunks = [c for c in self.index.chunks if c.num_steps]
        return (chunks[0].first_step, chunks[-1].last_step) if chunks else None

    @property
    def complete(self) -> bool:
        """True when the capture was closed cleanly (the seek index is present and readable)."""
        return self.index is not None

    def _add_damage(self, d: Damage) -> None:
        if d not in self.damage:
            self.damage.append(d)

    def close(self) -> None:
        """Release the file (after the read-ahead workers have stopped reading it)."""
        self._ahead.close()
        if self._inflater is not None:
            self._inflater.close()
        if isinstance(self._buf, mmap.mmap):
            self._buf.close()
        self._buf = b""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> CaptureReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
