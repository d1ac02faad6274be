"""`WriterContext`: the `with` statement both capture writers keep, `CaptureWriter` in this process and
`ProcessCaptureWriter` through a writer process."""

from __future__ import annotations

from replay.errors import CaptureError


class WriterContext:
    """`with writer:` for both writers: close on success; on an engine error close with that error as the footer
    status (every record written so far is complete); on a capture error stop without a footer."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif isinstance(exc, CaptureError):
            self.abandon()
        else:
            self.close(status=f"error: {exc_type.__name__}: {exc}"[:500])
