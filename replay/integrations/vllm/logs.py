"""vLLM's own output kept out of the way: while we drive a vLLM engine (`record --engine vllm`, `--runner vllm`),
everything it prints (its loggers on stdout, Python warnings, torch's and its C++ extensions' lines on stderr) goes
to a log file beside the capture, so the first line a user sees is ours. `replay -v` (REPLAY_VERBOSE=1) leaves it
on the terminal. A failure names the log and its last error line; the warnings that change numerics ("disabling
torch.compile", "Model Runner V2 requires Triton") are read back from it for the report's notes (with `-v` the user
reads them live).

The redirection is at the file-descriptor level (what C code writes cannot be caught otherwise). While it lasts,
`console` is a stream on the terminal's stderr, and `sys.stderr` points at it once the engine is built, so our own
progress lines still show.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import IO

from replay.capture.writing import filemode
from replay.errors import VERBOSE_ENV

# vLLM warnings that mean the engine runs other kernels or another runner than the user may think
NUMERICS_WARNINGS = ("disabling torch.compile", "Model Runner V2 requires Triton", "Triton is not installed",
                     "Falling back", "fall back", "not supported")


class VllmLog:
    """Where vLLM's output goes while a command drives it. Use `start()` before vLLM is imported or built, and
    `stop()` when done (also as a context manager)."""

    def __init__(self, beside: str | os.PathLike, suffix: str) -> None:
        self.verbose = os.environ.get(VERBOSE_ENV) == "1"
        self.path = _writable(Path(f"{beside}{suffix}"))
        self.console: IO[str] = sys.stderr
        self._saved: tuple[int, int] | None = None
        self._streams = (sys.stdout, sys.stderr)
        self._offset = 0  # where this run's part of the log starts

    def start(self) -> VllmLog:
        """Send fds 1 and 2 to the log (unless verbose) and start keeping numerics warnings."""
        if self.verbose or self._saved is not None:
            return self
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        self.console = os.fdopen(os.dup(self._saved[1]), "w", buffering=1)
        with filemode.create(self.path, append=True) as f:
            self._offset = f.tell()
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
        return self

    def ours(self) -> None:
        """From now on Python's sys.stderr is the terminal again (our progress), vLLM's handlers still write to the
        log: they hold the stream they were configured with."""
        if self._saved is not None:
            sys.stderr = self.console

    def stop(self) -> None:
        """Give the terminal back."""
        if self._saved is None:
            return
        sys.stdout.flush()
        try:
            sys.__stderr__.flush()
        except (AttributeError, ValueError):
            pass
        sys.stdout, sys.stderr = self._streams
        out, err = self._saved
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        self._saved = None
        self.console.close()
        self.console = sys.stderr

    def __enter__(self) -> VllmLog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def warnings(self) -> list[str]:
        """The numerics-relevant warnings vLLM logged so far in this run (none read with `-v`: they were shown)."""
        out: list[str] = []
        for line in self._lines():
            if " WARNING " in line and any(p.lower() in line.lower() for p in NUMERICS_WARNINGS):
                msg = " ".join(line.split("] ", 1)[-1].split())[:300]
                if msg not in out:
                    out.append(msg)
        return out

    def _lines(self) -> list[str]:
        if self.verbose:
            return []
        sys.stdout.flush()
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                return f.read().decode(errors="replace").splitlines()
        except OSError:
            return []

    def where(self) -> str:
        """' (vLLM's log: PATH; last error: ...)' for a failure message; '' when vLLM printed to the terminal."""
        if self.verbose:
            return ""
        errors = [x for x in self._lines()[-400:] if " ERROR " in x or x.startswith(("RuntimeError", "ValueError"))]
        last = "; last error: " + " ".join(errors[-1].split())[:200] if errors else ""
        return f" (vLLM's log: {self.path}{last})"


def _writable(path: Path) -> Path:
    """`path` if a log can be written there, else the same name in the temporary directory."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with filemode.create(path, append=True):
            pass
        return path
    except OSError:
        return Path(tempfile.gettempdir()) / path.name
