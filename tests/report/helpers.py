"""Helpers of the report tests: the CLI as a user runs it, and the data a report embeds."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

from replay.cli import main


def cli(*args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `replay ARGS...` through the real entry point."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def page_data(page: Path) -> dict:
    """The JSON a report embeds for its script."""
    text = page.read_text()
    return json.loads(re.search(r'<script type="application/json" id=report-data>(.*?)</script>', text, re.S)[1])
