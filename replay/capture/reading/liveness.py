"""Whether a capture without a footer is still being written: its writer holds a shared lock on the file for as long
as it writes (`replay.capture.writing.filemode.hold`), so a reader tells a live recording from one whose recorder
stopped without closing it."""

from __future__ import annotations

import fcntl
import os

from replay.capture.reading.damage import Damage

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


def unfinished(path: str | os.PathLike, advice: str = "") -> Damage:
    """What a capture without a footer or an index lacks: the tail its writer has not flushed yet, or (its writer
    gone) the records of its last open chunk, with `advice` after."""
    if being_written(path):
        return Damage("unfinished", STILL_WRITTEN)
    return Damage("unfinished", "capture was not closed (the recording stopped): records of its last open chunk are "
                                f"lost{advice}")


def still_written(damage: list[Damage]) -> bool:
    """Whether all that `damage` says is that the capture is still being written (nothing was lost)."""
    return bool(damage) and all(d.reason == STILL_WRITTEN for d in damage)
