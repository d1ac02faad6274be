"""`SealQueue`: a ring's snapshots, sealed one at a time on a thread of their own, beside the writer process's frame
loop.

Sealing reads a window's every chunk (its frames are copied, but each is decompressed for its checksum: a 256 MB
ring takes about a second, tens of seconds when every record was encoded again). On the frame loop that would stop
the engine, whose sends wait once the shared-memory channel is full; on this thread the frames keep flowing. The
segments a seal reads are pinned (`pins`, the ring's: the ring keeps every segment from the smallest pin on) until
it is done. A snapshot asked for while another is still waiting its turn joins that one: its window grows to the
newest segment and its trigger names both. So at most one seal runs and one waits, however often trouble repeats,
and the ring passes its size by no more than what arrives during two seals.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from replay.capture.flight.directory import RingDirectory
from replay.capture.flight.snapshot import SnapshotInfo, prune_snapshots, seal_snapshot


class Segment(Protocol):
    """A closed segment of the ring: its sequence number and file."""

    seq: int
    path: Path


@dataclass(slots=True, eq=False)
class _Seal:
    """One snapshot, queued or being sealed: the segments `first_seq`..`last_seq` (-1: none) into `out`."""

    out: Path
    first_seq: int
    last_seq: int
    status: str
    dropped_before: int
    triggers: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    future: Future | None = None
    started: bool = False

    @property
    def pin(self) -> str:
        return f"sealing {self.out.name}"

    def trigger(self) -> str:
        """What the snapshot says triggered it: the first trigger, and those that joined it."""
        first, *more = self.triggers
        return first if not more else f"{first}; then {len(more)} more: {'; '.join(more)}"[:500]


class SealQueue:
    """Seals a ring's snapshots in order on one thread; `pins` is the ring's, `closed()` its closed segments."""

    def __init__(self, files: RingDirectory, keep: int, pins: dict[str, int],
                 closed: Callable[[], list[Segment]]) -> None:
        self.files, self.keep, self.pins = files, keep, pins
        self.lock = threading.Lock()  # `pins` and a waiting seal's window, between the frame loop and this thread
        self._closed = closed
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay-seal")
        self._waiting: _Seal | None = None
        self._paths: set[Path] = set()  # snapshot files queued or being sealed
        self.sealed: list[str] = []  # snapshots sealed, oldest first
        self.errors: list[str] = []  # snapshots that failed, each also said on stderr (the engine's log)

    def queue(self, trigger: str, window: list[Segment], status: str = "ok", dropped_before: int = 0) -> Future:
        """Seal `window` (closed segments, oldest first) as a snapshot of `trigger`, with `status` in its footer;
        the future's result is its path. Joins the seal waiting its turn where that one's window covers this one's
        start and neither carries a status of its own (a crash's)."""
        first, last = (window[0].seq, window[-1].seq) if window else (-1, -1)
        with self.lock:
            w = self._waiting
            if w is not None and not w.started and status == w.status == "ok" and 0 <= w.first_seq <= first:
                w.last_seq = max(w.last_seq, last)
                w.triggers.append(trigger)
                return w.future
            seal = _Seal(self.files.snapshot(trigger, taken=self._paths), first, last, status, dropped_before,
                         [trigger])
            seal.future = self._pool.submit(self._seal, seal)  # (raises once closed: nothing is pinned then)
            self._paths.add(seal.out)
            if first >= 0:
                self.pins[seal.pin] = first
            self._waiting = seal
            return seal.future

    def _seal(self, seal: _Seal) -> Path:
        with self.lock:
            seal.started = True
            if self._waiting is seal:
                self._waiting = None
            segments = [s.path for s in list(self._closed()) if seal.first_seq <= s.seq <= seal.last_seq]
        info = SnapshotInfo(seal.trigger(), seal.created, str(self.files.dir), [p.name for p in segments],
                            dropped_before=seal.dropped_before)
        try:
            out = seal_snapshot(segments, seal.out, info, seal.status)
            self.sealed.append(str(out))
            prune_snapshots(self.files.snapshots, self.keep)
            return out
        except Exception as e:
            self.errors.append(f"{seal.out.name}: {e}")
            print(f"replay: snapshot {seal.out} failed: {e}", file=sys.stderr, flush=True)
            raise
        finally:
            with self.lock:
                self.pins.pop(seal.pin, None)
                self._paths.discard(seal.out)

    def unpin(self, why: str) -> None:
        """Drop the ring's pin `why` (from any thread)."""
        with self.lock:
            self.pins.pop(why, None)

    def close(self) -> None:
        """Seal what is queued, then stop the thread."""
        self._pool.shutdown(wait=True)
