"""Whether a capture without a footer is still being written: its writer holds a shared lock on the file for as long
as it writes (`replay.capture.writing.filemode.hold`), so a reader tells a live recording from one whose recorder
stopped without closing it."""

from __future__ import annotations

import fcntl
import os

# what the reader says of a capture still being written, in place of the loss an unfinished one means
STILL_WRITTEN = ("capture is still being written (its recorder holds it open): what it has not flushed yet is not "
                 "on disk; read it again once the recorder closes it")


def being_written(path: str | os.PathLike) -> bool:
    """True while a writer holds `path` open (a lock that cannot be taken, on a file system without locks, is no
    writer: False)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # (closing releases a lock taken here)
    return False
