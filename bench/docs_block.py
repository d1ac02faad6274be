"""Generated blocks of the docs: the text between two markers of a page, replaced by a benchmark's `--write-docs`,
so that figures are regenerated, never hand-copied."""

from __future__ import annotations

from pathlib import Path


def write_block(page: Path, start: str, end: str, text: str) -> None:
    """Replace what lies between `start` and `end` in `page` with `text`; SystemExit when a marker is missing."""
    s = page.read_text()
    if start not in s or end not in s:
        raise SystemExit(f"{page} has no {start} ... {end} block")
    head, rest = s.split(start, 1)
    _, tail = rest.split(end, 1)
    page.write_text(f"{head}{start}\n{text}\n{end}{tail}")
