"""`export_records`: every record of a capture as one JSON object per line, for other tools."""

from __future__ import annotations

import os
from typing import IO

from replay.capture import CaptureReader, Damage
from replay.errors import UsageError
from replay.jsonable import dumps

FORMATS = ("jsonl",)


def export_records(path: str | os.PathLike, out: IO[str], fmt: str = "jsonl") -> tuple[int, list[Damage]]:
    """Write each readable record of `path` to `out` as a JSON line (`{"type": "step", ...}`, request ids as
    strings, arrays as {dtype, shape, values}). Returns (records written, damage met)."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: supported formats are {', '.join(FORMATS)}")
    n = 0
    with CaptureReader(path) as r:
        for rec in r.records():
            out.write(dumps(rec))
            out.write("\n")
            n += 1
        return n, list(r.damage)
