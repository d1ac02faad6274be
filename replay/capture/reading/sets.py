"""Capture sets: what one command line names when it names several captures (a data-parallel server leaves one per
rank: `run.dp0.capture`, `run.dp1.capture`). A directory means every capture in it, a glob every capture it
matches; anything else is one capture."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from replay.errors import UsageError

_GLOB = set("*?[")


def capture_paths(spec: str | os.PathLike) -> list[Path]:
    """The captures `spec` names, in name order: a directory's `*.capture` files (and the `*.capture.partial` ones
    no finished capture stands for), a glob's matches, or `spec` itself."""
    text = str(spec)
    p = Path(text)
    if p.is_dir():
        found = [*p.glob("*.capture"), *p.glob("*.capture.partial")]
        what = f"{p}: no captures in this directory"
    elif _GLOB & set(text):
        found = [Path(x) for x in glob.glob(text)]
        what = f"{text}: no captures match"
    else:
        return [p]
    finished = {f.name for f in found if f.name.endswith(".capture")}
    found = [f for f in found if not (f.name.endswith(".partial") and f.name[: -len(".partial")] in finished)]
    if not found:
        raise UsageError(what)
    return sorted(found)
