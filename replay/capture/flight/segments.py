"""`SegmentRing`: the `CaptureWriter` API over a ring of segment files, in the writer process.

Each segment is a whole capture. When one passes its share of the ring (SIZE / SEGMENTS bytes on disk) it is closed
and the next opens with a keyframe: the writers share one `KeyframeMaker`, whose shadow of the request table goes on
from file to file. Closed segments past SIZE are deleted, oldest first, so the ring holds at most SIZE plus the segment
being written. A segment a pending snapshot still needs is not deleted (`pins`).

Snapshots (`snapshot`) seal the closed segments, the open one closed first, into one capture under `snapshots/`, the
last `keep` of them kept. The open segment is closed on the frame loop; the sealing runs beside it (`SealQueue`), so
that the engine never waits on a snapshot. They are taken
- on demand: `request(after)` (from `replay snapshot`, through the control thread), now or `after` more steps on;
- when the engine crashed: the crashing step, last, as in any capture;
- when a step's logprobs hold a NaN (or the engine counted NaNs in its logits);
- when a request finishes with an error (`trigger`, from vLLM's tap);
- when a request the client marked (`SamplingParams.extra_args["replay_snapshot"]`) finishes: the window from its
  arrival to its finish (the segments since it arrived are pinned meanwhile).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay.capture.flight.directory import (
    MIN_SEGMENT_BYTES,
    SEGMENTS,
    RingDirectory,
    keep_snapshots,
)
from replay.capture.flight.sealing import SealQueue
from replay.capture.format import records as fmt
from replay.capture.writing.keyframe_maker import KeyframeMaker
from replay.capture.writing.writer import CaptureWriter
from replay.contracts import EngineCoreRequest

MARK = "replay_snapshot"  # SamplingParams.extra_args key a client sets to keep its request's window


@dataclass(slots=True)
class _Segment:
    seq: int
    path: Path
    size: int = 0
    first_step: int = -1
    last_step: int = -1


@dataclass(slots=True)
class _Request:
    """A snapshot asked for: taken once step `target` is written (-1: at once)."""

    target: int
    done: threading.Event = field(default_factory=threading.Event)
    path: str = ""
    error: str = ""


class SegmentRing:
    """Writes a ring of segments under `directory`, `size` bytes on disk at most (plus the open segment)."""

    def __init__(self, directory: str | Path, header: fmt.Header, *, size: int,
                 chunk_bytes: int = fmt.DEFAULT_CHUNK_BYTES,
                 flush_interval: float = fmt.DEFAULT_FLUSH_INTERVAL, level: int = fmt.DEFAULT_LEVEL,
                 keep: int | None = None) -> None:
        self.files = RingDirectory(directory)
        self.files.create()
        self.header = header
        self.size = size
        self.segment_bytes = max(size // SEGMENTS, MIN_SEGMENT_BYTES)
        self.chunk_bytes = min(chunk_bytes, self.segment_bytes)  # (raw bytes: a chunk compresses to less)
        self.flush_interval, self.level = flush_interval, level
        self.keep = keep or keep_snapshots()
        self.maker = KeyframeMaker(header, 0)
        self.maker.shadow.watch = True
        self.closed: list[_Segment] = []
        self.pins: dict[str, int] = {}  # why -> the first segment it needs
        self.seals = SealQueue(self.files, self.keep, self.pins, lambda: self.closed)
        self.marked: dict[str, tuple[int, str]] = {}  # marked request (internal id) -> (first segment, its name)
        self.requests: list[_Request] = []
        self.dropped_before = 0  # steps before this one were dropped from the ring
        self.image_decoder = None
        self._crash: fmt.Crash | None = None
        self._seq = 0
        self._seen_nonfinite = 0
        self.files.writer_info.write_text(json.dumps({"pid": os.getpid(), "size": size, "keep": self.keep,
                                                       "segment_bytes": self.segment_bytes, "started": time.time()}))
        self.finished = False  # closed or abandoned: the control thread leaves it alone
        self.on_finish: list = []  # called once it is (the control socket closes: a request then seals offline)
        self._open()

    # -- the CaptureWriter API --------------------------------------------------------------------------------------

    @property
    def image_decoder(self) -> Any:
        """The converter of image steps (set by the writer process), handed to every segment's writer."""
        return self._decoder

    @image_decoder.setter
    def image_decoder(self, value: Any) -> None:
        """Set it for the open segment and the ones after it."""
        self._decoder = value
        if getattr(self, "current", None) is not None:
            self.current.image_decoder = value

    @property
    def snapshots(self) -> list[str]:
        """The snapshots sealed so far, oldest first."""
        return self.seals.sealed

    @property
    def seal_errors(self) -> list[str]:
        """The snapshots that failed, each with why."""
        return self.seals.errors

    @property
    def last_step(self) -> int:
        """The last step written (-1 before the first)."""
        return self._last_step

    @property
    def segments_written(self) -> int:
        """Segments opened so far (the open one included)."""
        return self._seq

    @property
    def num_records(self) -> int:
        """Records in the open segment."""
        return self.current.num_records

    def add_request(self, request: EngineCoreRequest, step: int) -> None:
        """An arrival; a request the client marked pins the ring from here until it finishes."""
        self.current.add_request(request, step)
        sp = request.sampling_params
        if sp is not None and sp.extra_args and sp.extra_args.get(MARK):
            self.marked[request.request_id] = (self._seq, request.name)
            self.pins[f"request {request.request_id}"] = self._seq

    def abort_request(self, request_id: str, step: int) -> None:
        """A client abort."""
        self.current.abort_request(request_id, step)

    def write_record(self, record: Any) -> None:
        """A step, an arrival or an abort given as a record."""
        if isinstance(record, fmt.RequestAdded):
            self.add_request(record.request, record.step)
            return
        self.current.write_record(record)
        if isinstance(record, fmt.Step):
            self._written(record.index)

    def write_step_image(self, index: int, *args: Any, **kw: Any) -> int:
        """Another engine's step, as images."""
        n = self.current.write_step_image(index, *args, **kw)
        self._written(index)
        return n

    def write_crash(self, crash: fmt.Crash) -> None:
        """The engine raised executing `crash.step`: that step comes next, then the crash's snapshot."""
        self._crash = crash
        self.current.write_crash(crash)

    def flush(self) -> None:
        """Close the open chunk now."""
        self.current.flush()

    def close(self, status: str = "ok") -> Path:
        """Close the open segment (the ring stays on disk) and finish the snapshots being sealed; answer what is
        still waiting. An engine that died (`fmt.ENGINE_DIED`) leaves a snapshot of the window that led there, with
        that status."""
        self._finish()
        self.current.close(status=status)
        self._closed_current()
        if status.startswith(fmt.ENGINE_DIED) and self.closed:
            self.seals.queue(status.removeprefix("error:").strip(), list(self.closed), status, self.dropped_before)
        self.seals.close()
        for r in self.requests:
            r.error = r.error or "the engine stopped before the snapshot's step"
            r.done.set()
        return self.files.dir

    def abandon(self) -> None:
        """Stop without a footer in the open segment (the snapshots being sealed are finished)."""
        self._finish()
        self.current.abandon()
        self.seals.close()

    def _finish(self) -> None:
        self.finished = True
        for f in self.on_finish:
            f()

    # -- snapshots ---------------------------------------------------------------------------------------------------

    def request(self, after: int = 0) -> _Request:
        """Ask for a snapshot `after` steps from now (0: now). Call with the writer process's lock held."""
        req = _Request(self._last_step + after if after > 0 else -1)
        if self.finished:  # (the control thread took the lock as the ring closed)
            req.error = "the recorder stopped"
            req.done.set()
            return req
        if req.target < 0:
            self._serve(req)
        else:
            self.requests.append(req)
            self.pins[f"request@{id(req)}"] = self.closed[0].seq if self.closed else self._seq
        return req

    def poll(self) -> None:
        """Look for what the shadow saw since the last look (finished marked requests, non-finite logprobs): the
        control thread calls it while the engine is idle, as every step does."""
        shadow = self.maker.shadow
        for rid in shadow.take_finished():
            mark = self.marked.pop(rid, None)
            if mark is not None:
                self._snapshot(f"request {mark[1]} (marked by the client)", first_seq=mark[0])
                self.pins.pop(f"request {rid}", None)
        bad = shadow.nonfinite
        if len(bad) > self._seen_nonfinite:
            self._seen_nonfinite = len(bad)
            self._snapshot(f"non-finite logprob at step {bad[-1]}")

    def trigger(self, why: str) -> None:
        """The engine saw trouble (a request finished with an error): seal a snapshot, once its step is written."""
        self._snapshot(why)

    def snapshot(self, trigger: str, status: str = "ok") -> Path:
        """Seal the ring's window now (the open segment closed first); returns once it is sealed."""
        return self._snapshot(trigger, status).result()

    def _serve(self, req: _Request) -> None:
        """Answer `req` once its snapshot is sealed (on the sealing thread: the frame loop goes on meanwhile)."""
        def answer(sealed: Future | None, error: str = "") -> None:
            try:
                req.path = str(sealed.result()) if sealed is not None else ""
            except Exception as e:  # noqa: BLE001 - said to whoever asked, in one line; the recording goes on
                error = f"{type(e).__name__}: {e}"
            req.error = error
            self.seals.unpin(f"request@{id(req)}")
            req.done.set()

        try:
            self._snapshot("on demand").add_done_callback(answer)
        except Exception as e:  # noqa: BLE001 - (closing the open segment failed)
            answer(None, f"{type(e).__name__}: {e}")

    def _snapshot(self, trigger: str, status: str = "ok", first_seq: int = 0) -> Future:
        """Close the open segment and queue the window's sealing; the future's result is the snapshot's path."""
        if self._first_step >= 0:
            self._rotate()
        window = [s for s in self.closed if s.seq >= first_seq]
        return self.seals.queue(trigger, window, status, self.dropped_before)

    # -- segments ----------------------------------------------------------------------------------------------------

    def _open(self) -> None:
        self._seq += 1
        self.maker.forced = self._seq > 1  # every segment but the first (at step 0) opens with a keyframe
        self.current = CaptureWriter(self.files.segment(self._seq), self.header, overwrite=True,
                                     chunk_bytes=self.chunk_bytes, flush_interval=self.flush_interval,
                                     level=self.level, keyframes=0, keyframe_maker=self.maker)
        self.current.image_decoder = self._decoder
        self._first_step = -1
        self._last_step = getattr(self, "_last_step", -1)

    def _written(self, index: int) -> None:
        """After each step: the crash's snapshot, the requests it was waiting for, the shadow's triggers, then a new
        segment if this one is full."""
        self._first_step = index if self._first_step < 0 else self._first_step
        self._last_step = index
        if self._crash is not None and self._crash.step == index:
            crash, self._crash = self._crash, None
            self._snapshot(f"crash at step {index}", crash.status())
        for req in [r for r in self.requests if 0 <= r.target <= index]:
            self.requests.remove(req)
            self._serve(req)
        self.poll()
        # a keyframe compresses about threefold: a segment is at least its keyframe's raw size, so that steps fill
        # two thirds of it or more however many requests are live (a long queue makes large keyframes)
        # (what is due, not what is written: under load the compression threads fall chunks behind)
        if self.current.bytes_due >= max(self.segment_bytes, self.current.keyframe_bytes):
            self._rotate()

    def _rotate(self) -> None:
        """Close the open segment, open the next, drop what the ring no longer holds."""
        self.current.close()
        self._closed_current()
        self._open()
        self._drop()

    def _closed_current(self) -> None:
        path = self.current.path
        size = path.stat().st_size if path.exists() else 0
        if self._first_step < 0:  # a segment without a step holds nothing a replay needs
            path.unlink(missing_ok=True)
            return
        self.closed.append(_Segment(self._seq, path, size, self._first_step, self._last_step))

    def _drop(self) -> None:
        with self.seals.lock:
            pinned = min(self.pins.values(), default=math.inf)
        total = sum(s.size for s in self.closed)
        while len(self.closed) > 1 and total > self.size and self.closed[0].seq < pinned:  # (the newest stays)
            s = self.closed.pop(0)
            total -= s.size
            s.path.unlink(missing_ok=True)
            self.dropped_before = s.last_step + 1
