"""Asking a ring for a snapshot from another process (`replay snapshot PATH`), and answering in the writer process.

The ring's writer process listens on an abstract Unix socket named after the ring's directory (`RingDirectory`): a
request is one JSON line, `{"after": N}`, and so is the answer, `{"path": ...}` or `{"error": ...}`, sent once the
snapshot is sealed. A connection that sends nothing is a probe (`replay info RING` asking whether a recorder runs)
and is answered by nothing. The same thread looks at the ring twice a second while the engine is idle
(`SegmentRing.poll`), so a trigger the last steps raised is not left waiting for the next step. When nothing answers
(the engine is gone), the closed segments on disk are sealed into a snapshot by the asking process itself.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path

import msgspec

from replay.capture.flight.directory import RingDirectory, keep_snapshots
from replay.capture.flight.segments import SegmentRing
from replay.capture.flight.snapshot import SnapshotInfo, prune_snapshots, seal_snapshot
from replay.errors import CaptureError, UsageError

POLL_S = 0.5


def start_control(ring: SegmentRing, lock: AbstractContextManager) -> threading.Thread:
    """Answer snapshot requests for `ring` on a daemon thread (the writer process's lock held while it acts)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(ring.files.control_address())
    sock.listen(8)
    sock.settimeout(POLL_S)
    ring.on_finish.append(sock.close)

    def loop() -> None:
        while not ring.finished:
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                with lock:
                    if not ring.finished:
                        ring.poll()
                continue
            except OSError:
                return
            threading.Thread(target=_answer, args=(conn, ring, lock), daemon=True).start()

    t = threading.Thread(target=loop, name="replay-ring-control", daemon=True)
    t.start()
    return t


def _answer(conn: socket.socket, ring: SegmentRing, lock: AbstractContextManager) -> None:
    with conn:
        try:
            conn.settimeout(10)
            line = conn.makefile("r").readline()
            if not line.strip():
                return
            ask = json.loads(line)
            after = int(ask.get("after", 0))
            with lock:
                if ring.finished:  # closing: no answer, so that `replay snapshot` seals the segments on disk itself
                    return
                req = ring.request(max(0, after))
            if not req.done.wait(float(ask.get("timeout", 3600))):
                answer = {"error": f"step {req.target} was not reached in time"}
            else:
                answer = {"path": req.path} if req.path else {"error": req.error or "no snapshot"}
        except Exception as e:  # noqa: BLE001 - the asking process gets one line, the recording goes on
            answer = {"error": f"{type(e).__name__}: {e}"}
        try:
            conn.sendall((json.dumps(answer) + "\n").encode())
        except OSError:
            pass


class SnapshotResult(msgspec.Struct):
    """Where a snapshot went, and who sealed it."""

    path: str
    ring: str
    live: bool  # sealed by the running recorder (else from the segments a stopped one left)


def request_snapshot(directory: str | Path, after: int = 0, timeout: float = 600.0) -> SnapshotResult:
    """Ask the ring at `directory` for a snapshot `after` steps from now (`replay snapshot`). Without a running
    recorder, the closed segments on disk are sealed here. Raises UsageError when `directory` is no ring,
    CaptureError when the snapshot fails."""
    ring_dir = RingDirectory(directory)
    if not ring_dir.dir.is_dir() or not (ring_dir.writer_info.exists() or ring_dir.segments()):
        raise UsageError(f"{directory}: not a ring (record with REPLAY_CAPTURE_RING=SIZE, or `replay record --ring`)")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(ring_dir.control_address())
    except OSError:
        sock.close()
        if after:
            raise UsageError(f"{directory}: no recorder is running there, so --after {after} cannot wait for steps; "
                             "without --after the segments on disk are sealed") from None
        return SnapshotResult(str(_offline(ring_dir)), str(directory), False)
    with sock:
        sock.settimeout(timeout + 5)
        try:
            sock.sendall((json.dumps({"after": after, "timeout": timeout}) + "\n").encode())
            line = sock.makefile("r").readline()
        except TimeoutError:
            raise CaptureError(directory, f"no snapshot within {timeout:g} s") from None
        except OSError:  # the recorder was closing as we asked
            line = ""
    if not line and not after:
        return SnapshotResult(str(_offline(ring_dir)), str(directory), False)
    answer = json.loads(line or '{"error": "the recorder went away before answering"}')
    if "error" in answer:
        raise CaptureError(directory, f"snapshot failed: {answer['error']}")
    return SnapshotResult(answer["path"], str(directory), True)


def _offline(ring_dir: RingDirectory) -> Path:
    """A snapshot of the closed segments a stopped recorder left."""
    segments = ring_dir.segments()
    ring_dir.snapshots.mkdir(exist_ok=True)
    info = SnapshotInfo("on demand, after the recorder stopped", time.time(), str(ring_dir.dir),
                        [p.name for p in segments])
    out = seal_snapshot(segments, ring_dir.snapshot("on demand"), info)
    prune_snapshots(ring_dir.snapshots, keep_snapshots())
    return out
