"""What both recorders (builtin and vLLM) report, and the progress bar they show while recording."""

from __future__ import annotations

import sys
from typing import IO

import msgspec


class RecordResult(msgspec.Struct):
    """The summary `replay record` prints."""

    path: str
    steps: int
    requests: int
    prompt_tokens: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float  # (prompt + generated) tokens / wall time
    capture_bytes: int

    @classmethod
    def of(cls, path: object, steps: int, requests: int, prompt_tokens: int, generated_tokens: int, wall_s: float,
           capture_bytes: int) -> RecordResult:
        """A result with the throughput worked out from the token counts and the wall time."""
        total = prompt_tokens + generated_tokens
        return cls(str(path), steps, requests, prompt_tokens, generated_tokens, round(wall_s, 3),
                   round(total / wall_s, 1) if wall_s > 0 else 0.0, capture_bytes)


class ProgressBar:
    """A stderr progress bar (rich) over generated tokens."""

    def __init__(self, total: int, file: IO[str] | None = None) -> None:
        """`file`: where the bar draws (default stderr; a terminal stream while an engine's output is redirected)."""
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._p = Progress(TextColumn("recording"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                           TimeElapsedColumn(), transient=True, console=Console(file=file or sys.stderr))
        self._p.start()
        self._task = self._p.add_task("record", total=total)

    def advance(self, n: int) -> None:
        """`n` more tokens generated."""
        self._p.advance(self._task, n)

    def close(self) -> None:
        """Take the bar off the terminal."""
        self._p.stop()
