"""Which capture a command's JSON was made on: a card from another run's bisect, explanation or trainer report would
sit on the page of the wrong run."""

from __future__ import annotations

import os
from pathlib import Path

from replay.errors import UsageError


def made_on(doc: dict, path: str | os.PathLike, capture: str | os.PathLike, what: str) -> None:
    """Raises UsageError where the JSON at `path` names another capture than the report's: its card would sit on a
    page of the wrong run. The path it names is as typed then, so one that no longer resolves is compared by name."""
    made = doc.get("capture")
    if not isinstance(made, str) or not made:
        return
    there, here = Path(made), Path(capture)
    try:
        same = there.samefile(here)
    except OSError:
        same = there.name == here.name
    if not same:
        raise UsageError(f"{path}: {what} of {made}, not of {capture}: run it on this capture, or report that one")
