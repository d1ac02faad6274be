"""Sealing a window of a ring into one capture: its segments' records, in order, under one header and one index.

Every segment opens with a keyframe, so the snapshot does too: its first step is that keyframe's, and a replay
starts there (`replay.replayer`). The segments' chunks are copied as the compressed frames they are (`splice`; a
segment of another kind record by record, image steps as images, keyframes as written); the header says what the
capture is (`Header.extra["snapshot"]`): what triggered it, its window, and what the ring had already dropped.
"""

from __future__ import annotations

import glob
import os
import re
import time
from pathlib import Path

import msgspec

from replay.capture.flight.splice import copy_chunks, splices
from replay.capture.format import records as fmt
from replay.capture.reading.reader import CaptureReader
from replay.capture.writing.writer import CaptureWriter
from replay.errors import CaptureError


class SnapshotInfo(msgspec.Struct, omit_defaults=True):
    """What a snapshot is, kept in its header (`extra["snapshot"]`) and shown by `replay info`."""

    trigger: str  # "on demand", "crash at step 812", "request r7 (marked by the client)", "non-finite logprob ..."
    created: float  # time.time()
    ring: str  # the ring directory it came from
    segments: list[str]  # the segment files it joined, oldest first
    first_step: int = -1  # its window (-1: no step)
    last_step: int = -1
    dropped_before: int = 0  # the ring had already dropped the steps before this one (0: nothing dropped)
    start_time: float = 0.0  # wall time of its first and last step (from their timings, when recorded)
    end_time: float = 0.0


def seal_snapshot(segments: list[Path], out: Path, info: SnapshotInfo, status: str = "ok") -> Path:
    """Join `segments` (closed capture files, oldest first) into the capture `out`, with `info` in its header and
    `status` in its footer. Returns `out`. A segment that cannot be read ends the snapshot there, said in its status."""
    if not segments:
        raise CaptureError(out, "nothing to snapshot: the ring holds no closed segment yet")
    header = _window(segments, info)
    header = msgspec.structs.replace(header, extra={**header.extra, "snapshot": msgspec.to_builtins(info)})
    writer = CaptureWriter(out, header, keyframes=0)
    lost: list[str] = []
    try:
        for path in segments:
            try:
                with CaptureReader(path) as r:
                    if splices(r):
                        lost += copy_chunks(r, writer)
                    else:
                        for rec in r.records(images=True):
                            writer.write_record(rec)
                    lost += [f"{path.name}: {d.describe()}" for d in r.damage]
            except CaptureError as e:
                lost.append(f"{path.name}: {e}")
                break
        writer.close(status=status if not lost else f"{status}; lost: {'; '.join(lost)}"[:1000])
    except BaseException:
        writer.abandon()  # (its threads and file: a failed close leaves the .partial behind)
        raise
    return out


def _window(segments: list[Path], info: SnapshotInfo) -> fmt.Header:
    """The first segment's header; the window's steps and wall-clock span into `info` (from the segments' indexes
    and their first and last steps' timings, monotonic clock read as this host's wall clock)."""
    clock = time.time() - time.monotonic()
    header = None
    for path in segments:
        try:
            with CaptureReader(path) as r:
                header = header or r.header
                span = r.step_span()
                if span is None:
                    continue
                if info.first_step < 0:
                    info.first_step = span[0]
                    t = r.step(span[0]).timing
                    info.start_time = clock + t.start_ns / 1e9 if t is not None and t.start_ns else 0.0
                info.last_step = span[1]
                t = r.step(span[1]).timing
                info.end_time = clock + t.start_ns / 1e9 if t is not None and t.start_ns else info.end_time
        except CaptureError:
            break  # (the copy stops there too, and says why)
    if header is None:
        raise CaptureError(segments[0], "no readable segment to snapshot")
    info.dropped_before = info.dropped_before or max(info.first_step, 0)  # (a capture begins at step 0)
    return header


def _age(path: Path) -> tuple[int, int]:
    """Oldest first: by modification time, then, for two sealed within the filesystem's timestamp granularity
    under one name, by the counter the later one got (`...-on-demand.capture`, then `...-on-demand-2.capture`)."""
    m = re.search(r"-(\d+)\.capture$", path.name)
    return path.stat().st_mtime_ns, int(m.group(1)) if m else 0


def prune_snapshots(directory: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` snapshots in `directory`, with what was written beside each (a replay's
    `SNAPSHOT.vllm-replay.log`); returns the snapshots deleted."""
    found = sorted(directory.glob("snapshot-*.capture"), key=_age)
    gone = found[: max(0, len(found) - keep)]
    for p in gone:
        for f in [p, *directory.glob(glob.escape(p.name) + ".*")]:
            try:
                os.unlink(f)
            except OSError:
                pass
    return gone
