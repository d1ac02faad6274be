"""A ring's directory: where its segments, its snapshots and its control address are.

    PATH/                           REPLAY_CAPTURE (or `record --out`), with REPLAY_CAPTURE_RING=SIZE
      segment-000007.capture        each a whole capture: a header, a keyframe, steps, a footer and an index
      segment-000008.capture.partial  the one being written
      snapshots/snapshot-20261205-101500-on-demand.capture   what a snapshot sealed, the last `keep` of them
      writer.json                   the writer process's pid and the ring's settings

The writer process listens on an abstract Unix socket named after the directory's real path (`control_address`), so
`replay snapshot PATH` reaches it from another shell with nothing to clean up when it dies.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

from replay.errors import UsageError

RING_ENV = "REPLAY_CAPTURE_RING"  # SIZE: record into a ring of that many bytes under REPLAY_CAPTURE
KEEP_ENV = "REPLAY_SNAPSHOT_KEEP"  # snapshots kept in PATH/snapshots (default DEFAULT_KEEP)
DEFAULT_KEEP = 8
SEGMENTS = 8  # a ring holds about this many segments: a snapshot loses at most an eighth of the window to dropping
MIN_SEGMENT_BYTES = 64 << 10
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
_SEGMENT = re.compile(r"segment-(\d{6,})\.capture$")


def parse_size(text: str, what: str = RING_ENV) -> int:
    """'512MB' / '4 MiB' / '1g' / '65536' -> bytes (binary units). Raises UsageError naming `what`."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text or "")
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise UsageError(f"{what}={text!r}: expected a size such as 512MB, 4MiB or 1GB")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < 2 * MIN_SEGMENT_BYTES:
        raise UsageError(f"{what}={text!r}: a ring needs at least {2 * MIN_SEGMENT_BYTES >> 10} KiB")
    return n


class RingDirectory:
    """The paths of one ring directory."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)
        self.snapshots = self.dir / "snapshots"
        self.writer_info = self.dir / "writer.json"

    def create(self) -> None:
        """Make the directory and its snapshots folder; remove segments an earlier recording left (its snapshots
        stay)."""
        self.snapshots.mkdir(parents=True, exist_ok=True)
        for p in self.dir.glob("segment-*.capture*"):
            p.unlink(missing_ok=True)

    def segment(self, seq: int) -> Path:
        """The path of segment `seq`."""
        return self.dir / f"segment-{seq:06d}.capture"

    def segments(self) -> list[Path]:
        """The closed segments on disk, oldest first."""
        found = [(int(m.group(1)), p) for p in self.dir.glob("segment-*.capture") if (m := _SEGMENT.search(p.name))]
        return [p for _, p in sorted(found)]

    def snapshot(self, trigger: str, taken: set[Path] | frozenset = frozenset()) -> Path:
        """A new snapshot's path: its time and what triggered it (none that exists, nor one of `taken`: paths
        given to snapshots still being sealed)."""
        slug = re.sub(r"[^a-z0-9]+", "-", trigger.lower()).strip("-")[:40] or "snapshot"
        stem = f"snapshot-{time.strftime('%Y%m%d-%H%M%S')}-{slug}"
        path, n = self.snapshots / f"{stem}.capture", 1
        while path.exists() or path in taken:
            n += 1
            path = self.snapshots / f"{stem}-{n}.capture"
        return path

    def control_address(self) -> str:
        """The abstract Unix socket the ring's writer process answers on."""
        digest = hashlib.sha1(str(self.dir.resolve()).encode()).hexdigest()[:20]
        return f"\0replay-ring-{digest}"


def keep_snapshots() -> int:
    """How many snapshots a ring keeps (REPLAY_SNAPSHOT_KEEP, default DEFAULT_KEEP)."""
    raw = os.environ.get(KEEP_ENV, "").strip()
    if not raw:
        return DEFAULT_KEEP
    if not raw.isdigit() or int(raw) < 1:
        raise UsageError(f"{KEEP_ENV}={raw!r}: expected a positive number of snapshots")
    return int(raw)
