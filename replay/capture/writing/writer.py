"""`CaptureWriter`: append records to a capture from any engine.

Encoding (msgspec, id interning) runs on the caller's thread: it is cheap and it must see the objects before the
engine mutates them. Compression and I/O run on background threads (`emitter`), which zstd and file writes let
run without the GIL. Chunks close by size or by age, so a crash loses at most the open chunk (at most
`flush_interval` seconds of steps, or `chunk_bytes` of records). Errors of the background threads (a full disk)
surface, as one CaptureError, on the next call.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import msgspec
import zstandard

from replay.capture.codec.outline import ImageOutline
from replay.capture.codec.step_image import OutputParts, is_nil, store_step_image
from replay.capture.codec.stepcodec import stored_step
from replay.capture.format import records as fmt
from replay.capture.format.frames import skippable_frame
from replay.capture.format.ids import LiveIdTable
from replay.capture.format.keyframe import Keyframe
from replay.capture.writing import filemode
from replay.capture.writing.chunk import Chunk, CopiedChunk, encode_record
from replay.capture.writing.context import WriterContext
from replay.capture.writing.emitter import CATCH_UP_LEVEL, open_emitter
from replay.capture.writing.keyframe_maker import KeyframeMaker, keyframe_interval
from replay.contracts import (
    DraftCounts,
    EngineCoreRequest,
    ModelRunnerOutput,
    SchedulerOutput,
    draft_counts,
)
from replay.errors import CaptureError, UsageError


class CaptureWriter(WriterContext):
    """Writes a capture to `path` (as `path.partial` until `close`), compressed at zstd `level`; while the recorder
    outruns compression, at `catch_up_level` (None: never; `replay.capture.writing.emitter`). The file is created with
    `mode` (default 0600, or REPLAY_CAPTURE_MODE: `replay.capture.writing.filemode`). A keyframe (format 1.6) opens a
    chunk every `keyframes` steps (default REPLAY_KEYFRAME_STEPS, else 4096; 0: none): the writer's shadow of the
    request table (`replay.capture.writing.keyframe_maker`).

    Usage::

        with CaptureWriter(path, Header(...)) as w:
            w.add_request(request, step=0)
            w.write_step(0, scheduler_output, model_runner_output)
    """

    def __init__(self, path: str | os.PathLike, header: fmt.Header, *, chunk_bytes: int = fmt.DEFAULT_CHUNK_BYTES,
                 flush_interval: float = fmt.DEFAULT_FLUSH_INTERVAL, level: int = fmt.DEFAULT_LEVEL,
                 overwrite: bool = False, fsync: bool = False, partial_path: str | os.PathLike | None = None,
                 catch_up_level: int | None = CATCH_UP_LEVEL, mode: int | None = None, keyframes: int | None = None,
                 keyframe_maker: KeyframeMaker | None = None):
        self.path = Path(path)
        self.partial_path = Path(partial_path) if partial_path else self.path.with_name(self.path.name + ".partial")
        if not overwrite and self.path.exists():
            raise UsageError(f"{self.path}: already exists (pass overwrite=True / --force to replace it)")
        if chunk_bytes <= 0 or flush_interval <= 0:
            raise UsageError("chunk_bytes and flush_interval must be positive")
        self.chunk_bytes = chunk_bytes
        self.flush_interval = flush_interval
        self._cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)  # (the index)
        self._ids = LiveIdTable()
        interval = keyframe_interval(keyframes)
        self._keyframes: KeyframeMaker | None = None  # (from the first record after the header on)
        self.image_decoder = None  # an ImageDecoder (for drafts in image steps), made on first use if not given
        self._lock = threading.Lock()
        self._chunk = Chunk()
        self._num_steps = 0
        self._num_records = 0
        self._last_step = -1
        self._requests_before = 0  # requests copied chunks name without their arrival (`write_chunk`)
        self._closed = self._closing = False
        self.keyframe_bytes = 0  # the last keyframe's size, uncompressed
        try:
            self.partial_path.parent.mkdir(parents=True, exist_ok=True)
            self._f = filemode.create(self.partial_path, mode=mode)
            filemode.hold(self._f)
            self._out = open_emitter(self._f, level=level, fsync=fsync, interval=flush_interval, idle=self._idle_seal,
                                    catch_up_level=catch_up_level)
            prologue = fmt.PROLOGUE_ID + struct.pack("<HH", fmt.FORMAT_MAJOR, fmt.FORMAT_MINOR)
            self._out.write(skippable_frame(fmt.PROLOGUE_MAGIC, prologue))
        except OSError as e:
            raise CaptureError(self.partial_path, f"cannot create capture: {e.strerror or e}") from None
        self._out.start()
        self._append([encode_record(header)])
        self.flush()  # the header is durable as soon as the writer exists; a ring's segments share a keyframe maker
        self._keyframes = keyframe_maker or (KeyframeMaker(header, interval) if interval else None)

    # -- public API ---------------------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, step: int) -> None:
        """Record a request arrival; `step` is the index of the next step to run."""
        prompt = request.prompt_token_ids
        if isinstance(prompt, (list, tuple)) and not all(type(t) is int for t in prompt):
            # (msgspec would store a float or a bool as it is, and the reader's list[int] refuse the record)
            raise UsageError(f"cannot record request {request.request_id!r}: its prompt_token_ids are not all ints")
        record = fmt.RequestAdded(step, request)
        data = encode_record(record)  # (its id is interned by the first step that names it)
        self._append([data], requests_added=1, fold=record)

    def abort_request(self, request_id: str, step: int) -> None:
        """Record a client abort before step `step`."""
        record = fmt.RequestAborted(step, request_id)
        self._append([encode_record(record)], fold=record)

    def write_step(self, index: int, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput | None,
                   **extra: Any) -> int:
        """Record one engine step (extra: `drawn_seeds`, `rng_state`, `timing`, `grammar_output` of `Step`).

        Returns the encoded size in bytes. Call it before the engine mutates either object again.
        """
        return self.write_step_record(fmt.Step(index, scheduler_output, model_runner_output, **extra))

    def write_step_record(self, step: fmt.Step) -> int:
        """Record an already built `Step` (in-memory form, string ids)."""
        if step.index <= self._last_step:
            raise UsageError(f"step {step.index} written after step {self._last_step}: steps must increase")
        mro = step.model_runner_output
        drafts = draft_counts(step.scheduler_output,
                              mro) if step.scheduler_output.scheduled_spec_decode_tokens else None
        self._check()
        with self._lock:  # interning mutates the shared id table; the step and its logprob rows join one chunk
            self._seal_if_old_locked()
            wire, generated = stored_step(step, self._ids, self._chunk.columns)
            data = encode_record(wire)  # (before the declarations are taken: a step refused leaves them to the next)
            if self._chunk.declared:
                declare = self._ids.take_new()
            else:  # a chunk's first step: every live handle (new ones included), so the chunk reads on its own
                self._chunk.declared, declare = True, self._ids.live()
            parts = [encode_record(declare), data] if declare is not None else [data]
            self._append_locked(parts, step=step.index, scheduled=step.scheduler_output.total_num_scheduled_tokens,
                                generated=generated, drafts=drafts, fold=step)
            for rid in step.scheduler_output.finished_req_ids:  # named for the last time: the runner drops them
                self._ids.drop(rid)
        self._last_step = step.index
        return sum(len(p) for p in parts)

    def write_step_image(self, index: int, scheduler_output: bytes, model_runner_output: bytes | OutputParts | None,
                         grammar_output: bytes | None = None, timing: fmt.StepTiming | None = None) -> int:
        """Record one step of another engine given as its objects' msgpack images (`StepImage`, format 1.3):
        stored as they are, logprob matrices into the chunk's columns; readers convert them. Returns the bytes
        stored. Raises UsageError when an image is not msgpack."""
        if index <= self._last_step:
            raise UsageError(f"step {index} written after step {self._last_step}: steps must increase")
        if self.image_decoder is None:
            from replay.contracts.image_decoder import ImageDecoder

            self.image_decoder = ImageDecoder()
        self._check()
        with self._lock:  # the step and its logprob rows join one chunk
            self._seal_if_old_locked()
            c, parts = self._chunk, model_runner_output
            outline = ImageOutline(index, scheduler_output, parts)  # what the keyframe shadow folds
            try:  # an output in parts is finished with its chunk (PartsBatch) when it can be
                scheduled = c.batch.add(index, scheduler_output, parts, grammar_output, timing, c.columns) \
                    if isinstance(parts, OutputParts) else None
                if scheduled is None:
                    rec, stats = store_step_image(index, scheduler_output, parts, grammar_output, timing, c.columns,
                                                  self.image_decoder)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                raise UsageError(f"cannot record step {index}: its image is not what an engine's tap sends "
                                 f"({e})") from None
            if scheduled is not None:
                size = len(scheduler_output) + len(parts.rest) + len(parts.tokens) + 64
                self._append_locked([None], raw=size, step=index, scheduled=scheduled, fold=outline)
            else:
                size = len(data := encode_record(rec))
                self._append_locked([data], step=index, scheduled=stats.scheduled, generated=stats.generated,
                                    drafts=stats.drafts, fold=outline)
        self._last_step = index
        return size

    def write_crash(self, crash: fmt.Crash) -> None:
        """Record that the engine raised while executing step `crash.step`; write that step's `Step` (scheduled,
        no output) right after it."""
        self._append([encode_record(crash)])

    @property
    def last_step(self) -> int:
        """The index of the last step written (-1 before the first)."""
        return self._last_step

    def write_record(self, record: fmt.Record) -> None:
        """Copy a record read from another capture (`recover`, rewriting a capture): steps (image steps as images),
        arrivals, aborts, crashes and keyframes; a Header or Footer is this writer's own to write, so it is skipped."""
        if isinstance(record, fmt.Step):
            self.write_step_record(record)
        elif isinstance(record, fmt.StepImage):  # another engine's step, output whole (`records(images=True)`)
            self.write_step_image(record.index, *(None if is_nil(x) else bytes(x) for x in (
                record.scheduler_output, record.model_runner_output, record.grammar_output)), record.timing)
        elif isinstance(record, fmt.RequestAdded):
            self.add_request(record.request, record.step)
        elif isinstance(record, fmt.RequestAborted):
            self.abort_request(record.request_id, record.step)
        elif isinstance(record, fmt.Crash):
            self.write_crash(record)
        elif isinstance(record, Keyframe):
            self.write_keyframe(record)

    def write_keyframe(self, keyframe: Keyframe) -> None:
        """Copy a keyframe read from another capture (`recover`, a snapshot) into a chunk of its own (one before any
        step holds requests whose arrivals are not in this capture); a writer making its own keyframes refuses it."""
        if self._keyframes is not None:
            raise UsageError("a writer that makes its own keyframes takes none from another capture")
        self._check()
        with self._lock:
            self._seal_locked()
            self._put_keyframe(self._chunk, keyframe)
            self._requests_before += len(keyframe.requests) if not self._num_steps else 0

    def write_chunk(self, chunk: CopiedChunk, requests: int = 0) -> None:
        """Append a chunk of another capture as its compressed frame, after all written so far (a snapshot);
        `requests`: those it names without their arrival (a keyframe's). Refused where keyframes are made here."""
        info = chunk.info
        if self._closed:
            raise UsageError(f"{self.path}: capture writer is closed")
        if self._keyframes is not None:
            raise UsageError("a writer that makes its own keyframes cannot fold a chunk it does not read")
        if info.num_steps and info.first_step <= self._last_step:
            raise UsageError(f"step {info.first_step} written after step {self._last_step}: steps must increase")
        self._check()
        with self._lock:
            self._seal_locked()
            self._num_records += info.num_records
            self._num_steps += info.num_steps
            self._requests_before += requests
            self._out.put(chunk)
        self._last_step = max(self._last_step, info.last_step)

    def flush(self) -> None:
        """Close the open chunk now and hand it to the background threads."""
        self._check()
        with self._lock:
            self._seal_locked()

    def close(self, status: str = "ok") -> Path:
        """Write the footer and the seek index, then rename `NAME.partial` to `NAME`. Returns the final path."""
        if self._closed:
            return self.path
        self._closing = True  # (no keyframe for the footer's chunk: no step follows it)
        self._append([encode_record(fmt.Footer(self._num_steps, self._num_records + 1, status))])
        with self._lock:
            self._seal_locked()
        self._closed = True
        self._out.stop()
        try:
            self._check()
            chunks = list(self._out.chunks)
            arrivals = sum(c.num_requests_added for c in chunks) + self._requests_before
            index = fmt.Index(chunks, [], self._num_steps, status, max(self._ids.count, arrivals))  # type: ignore[arg-type]
            body = self._cctx.compress(fmt.WIRE_ENCODER.encode(index))
            offset = self.bytes_written
            trailer = struct.pack("<IQ", zlib.crc32(body), offset) + fmt.INDEX_TRAILER_ZSTD
            self._out.write(skippable_frame(fmt.INDEX_MAGIC, body + trailer))
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.partial_path, self.path)
        except OSError as e:
            raise CaptureError(self.partial_path, f"cannot finish capture: {e.strerror or e}") from None
        finally:
            if not self._f.closed:  # (it failed: what was written stays in NAME.partial for `recover`)
                with contextlib.suppress(OSError):
                    self._f.close()
        return self.path

    def abandon(self) -> None:
        """Stop writing without a footer: what was flushed stays in `NAME.partial` for `recover`."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._seal_locked()
        self._out.stop()
        try:
            self._f.close()
        except OSError:
            pass

    @property
    def bytes_written(self) -> int:
        """Bytes in the file so far (frames written, not those still being compressed)."""
        return self._out.bytes_written

    @property
    def bytes_due(self) -> int:
        """Bytes the file will hold once the chunks sealed so far are written (`ChunkEmitter.bytes_due`)."""
        return self._out.bytes_due

    @property
    def num_steps(self) -> int:
        """Steps written so far."""
        return self._num_steps

    @property
    def chunks_caught_up(self) -> int:
        """Chunks compressed at the catch-up level, the recorder outrunning compression (final once closed)."""
        return self._out.caught_up

    @property
    def num_records(self) -> int:
        """Records written so far (id declarations and the footer included)."""
        return self._num_records

    # -- internals ------------------------------------------------------------------------------------------------

    def _append(self, parts: list[bytes], *, step: int | None = None, scheduled: int = 0, generated: int = 0,
                requests_added: int = 0, drafts: DraftCounts | None = None, fold: Any = None) -> None:
        self._check()
        with self._lock:
            self._seal_if_old_locked()
            self._append_locked(parts, step=step, scheduled=scheduled, generated=generated,
                                requests_added=requests_added, drafts=drafts, fold=fold)

    def _seal_if_old_locked(self) -> None:
        c = self._chunk
        if c.raw and (time.monotonic() - c.born >= self.flush_interval or (
                self._keyframes is not None and not self._closing and self._keyframes.due_at(self._last_step + 1))):
            self._seal_locked()  # (a keyframe opens the next chunk: a reader can start there)

    def _append_locked(self, parts: list[bytes | None], *, step: int | None = None, scheduled: int = 0,
                       generated: int = 0, requests_added: int = 0, drafts: DraftCounts | None = None,
                       raw: int | None = None, fold: Any = None) -> None:
        if self._closed:
            raise UsageError(f"{self.path}: capture writer is closed")
        c = self._chunk
        if not c.parts and self._keyframes is not None and not self._closing and self._keyframes.due():
            self._put_keyframe(c, self._keyframes.make())
        if fold is not None and self._keyframes is not None:  # (an image step's stored record: the last of `parts`)
            c.folds.append(fold._replace(part=len(c.parts) + len(parts) - 1) if isinstance(fold, ImageOutline)
                           else fold)
        c.parts.extend(parts)
        c.raw += sum(map(len, parts)) if raw is None else raw
        info = c.info
        info.num_records += len(parts)
        self._num_records += len(parts)
        if step is not None:
            if info.first_step < 0:
                info.first_step = step
            info.last_step = step
            info.num_steps += 1
            info.num_scheduled_tokens += scheduled
            info.num_generated_tokens += generated
            if drafts is not None:
                info.num_draft_tokens += drafts.drafted
                info.num_accepted_draft_tokens += drafts.accepted
            self._num_steps += 1
        info.num_requests_added += requests_added
        if c.raw + c.columns.nbytes >= self.chunk_bytes:
            self._seal_locked()

    def _put_keyframe(self, c: Chunk, keyframe: Keyframe) -> None:
        """Put a keyframe first in the chunk `c`, just opened (format 1.6), and say so in its index entry."""
        data = encode_record(keyframe)
        self.keyframe_bytes = len(data)
        c.parts.append(data)
        c.raw += len(data)
        c.info.num_records += 1
        c.info.keyframe = keyframe.step
        self._num_records += 1

    def _sealed(self, c: Chunk) -> None:
        """Seal `c` and fold it into the keyframe shadow."""
        c.seal(self.image_decoder)
        if self._keyframes is not None:
            self._keyframes.fold(c.folds, c.parts)
            c.folds = []

    def _seal_locked(self) -> None:
        c = self._chunk
        if not c.parts:
            return
        self._chunk = Chunk()
        self._sealed(c)
        self._out.put(c)  # blocks while the background threads are 8 chunks behind

    def _idle_seal(self) -> tuple[int, Chunk] | None:
        """The open chunk, sealed and numbered, once it is older than `flush_interval` (a background thread asks
        when it has waited that long for work). Never blocks on the lock: a producer holding it may itself be
        blocked on the full queue."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            c = self._chunk
            if not c.parts or time.monotonic() - c.born < self.flush_interval or self._closed:
                return None
            self._chunk = Chunk()
            self._sealed(c)
            return self._out.number(), c
        finally:
            self._lock.release()

    def _check(self) -> None:
        e = self._out.error
        if e is not None:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise CaptureError(self.partial_path,
                               f"writing failed: {why}; what was flushed before stays readable") from None

