"""Who may read a capture: its file (and the logs written beside it) is created mode 0600, as core dumps are, since
a server's capture holds every user's prompt token ids. `REPLAY_CAPTURE_MODE` (octal, e.g. `0640` for a group of
debuggers) chooses another mode; the writer process and the engine's workers inherit it with the environment."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from replay.errors import UsageError

MODE_ENV = "REPLAY_CAPTURE_MODE"
DEFAULT_MODE = 0o600


def capture_mode() -> int:
    """The mode new captures and their logs get: REPLAY_CAPTURE_MODE (octal), else 0600."""
    raw = os.environ.get(MODE_ENV, "").strip()
    if not raw:
        return DEFAULT_MODE
    try:
        mode = int(raw, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777 or not mode & 0o600 == 0o600:
        raise UsageError(f"{MODE_ENV}={raw!r}: expected an octal file mode the owner can read and write, "
                         "such as 0600 or 0640")
    return mode


def hold(f: BinaryIO) -> None:
    """Hold a shared lock on a capture being written, for as long as `f` is open: readers then know it is still
    being written (`replay.capture.reading.liveness`). A file system without locks goes without."""
    import fcntl

    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        pass


def create(path: str | os.PathLike, *, append: bool = False, mode: int | None = None) -> BinaryIO:
    """Open `path` for writing (truncated, or appended to), with exactly `mode` (default `capture_mode()`), whatever
    the umask or the mode of a file that was there before."""
    mode = capture_mode() if mode is None else mode
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(Path(path), flags, mode)
    try:
        os.fchmod(fd, mode)
        return os.fdopen(fd, "ab" if append else "wb")
    except BaseException:
        os.close(fd)
        raise
