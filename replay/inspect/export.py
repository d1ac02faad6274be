"""`export_records`: a capture for other tools: every record as one JSON object per line (jsonl), or a timeline
for trace viewers (perfetto: `replay.inspect.perfetto`)."""

from __future__ import annotations

import os
from typing import IO

from replay.capture import CaptureReader, Damage
from replay.errors import UsageError
from replay.inspect.perfetto import export_perfetto
from replay.jsonable import dumps

FORMATS = ("jsonl", "perfetto")


def export_records(path: str | os.PathLike, out: IO[str], fmt: str = "jsonl") -> tuple[int, list[Damage]]:
    """Write each readable record of `path` to `out` as a JSON line (`{"type": "step", ...}`, request ids as
    strings, arrays as {dtype, shape, values}); with `fmt="perfetto"`, the Chrome trace-event document of
    `export_perfetto` instead. Returns (records, or trace events, written; damage met)."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: supported formats are {', '.join(FORMATS)}")
    if fmt == "perfetto":
        return export_perfetto(path, out)
    n = 0
    with CaptureReader(path) as r:
        for rec in r.records():
            out.write(dumps(rec))
            out.write("\n")
            n += 1
        return n, list(r.damage)
