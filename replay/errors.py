"""One exception tree for the whole tool; each error knows its exit code and builds its own one-line message.

Exit codes (docs/design.md, "Errors"): 0 ok, 1 divergence found (or, for `recover`, nothing recoverable), 2 usage or
unreadable input, 3 completed on a damaged capture (data was lost), 125 cannot test (bisect predicate).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_DIVERGED = 1
EXIT_USAGE = 2
EXIT_DAMAGED = 3
EXIT_CANNOT_TEST = 125

# `replay -v`: tracebacks of errors, and the output of the engines we drive, on the terminal. An environment
# variable, not a global: the processes a command starts (vLLM's) see it too.
VERBOSE_ENV = "REPLAY_VERBOSE"


class ReplayError(Exception):
    """Base of every error the package raises on purpose; the CLI prints `str(err)` and exits `err.exit_code`."""

    exit_code = EXIT_USAGE


class UsageError(ReplayError):
    """The command line or a Python argument asks for something that cannot be done."""


class CaptureError(ReplayError):
    """A capture file could not be read as asked. Names the file, and the chunk and offset where known."""

    def __init__(self, path: object, reason: str, *, chunk: int | None = None, offset: int | None = None):
        self.path = str(path)
        self.reason = reason
        self.chunk = chunk
        self.offset = offset
        where = []
        if chunk is not None:
            where.append(f"chunk {chunk}")
        if offset is not None:
            where.append(f"byte {offset}")
        loc = f" ({', '.join(where)})" if where else ""
        super().__init__(f"{self.path}{loc}: {reason}")


class NotACaptureError(CaptureError):
    """The file is empty, is not a capture, or is cut before its header: nothing in it can be read."""


class HeaderLostError(NotACaptureError):
    """The file starts like a capture but its header chunk is cut off or unreadable."""


class UnsupportedVersionError(CaptureError):
    """The capture was written by a newer major format version than this reader understands."""


class CaptureDamagedError(CaptureError):
    """Part of the capture is lost (bad checksum, truncated, unfinished); raised only where the caller asked
    for strict reading. Lenient readers record a `Damage` entry instead and carry on."""

    exit_code = EXIT_DAMAGED


class LimitExceededError(CaptureError):
    """A frame or record claims more memory than the reader's limits allow (decompression-bomb guard)."""

    exit_code = EXIT_DAMAGED


class NothingRecoverableError(CaptureError):
    """`recover` found no readable header or record in the input."""

    exit_code = EXIT_DIVERGED


class CannotTestError(ReplayError):
    """The question cannot be answered on this setup (a bisect whose instruments stayed silent): exit 125, so that
    `git bisect run` skips the commit rather than call it good or bad."""

    exit_code = EXIT_CANNOT_TEST
