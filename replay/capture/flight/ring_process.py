"""The ring's writer process, and the engine-side writer that starts it (`ring_writer`).

The same frames, the same loop as a capture's writer process (`replay.capture.writing.writer_child.serve`), into a
`SegmentRing`; plus the control thread that answers `replay snapshot` (`replay.capture.flight.control`). The frames
are handled under one lock, which the control thread takes between two of them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

from replay.capture.flight.control import start_control
from replay.capture.flight.segments import SegmentRing
from replay.capture.format import records as fmt
from replay.capture.writing.writer_child import serve
from replay.capture.writing.writer_process import ProcessCaptureWriter

CHILD = "replay.capture.flight.ring_process"


def ring_writer(path: str | os.PathLike, header: fmt.Header, size: int, **kw: Any) -> ProcessCaptureWriter:
    """A `ProcessCaptureWriter` whose writer process records into a ring of `size` bytes in the directory `path`
    (keyword arguments: ProcessCaptureWriter's)."""
    return ProcessCaptureWriter(path, header, child=CHILD, child_options={"ring_size": size}, **kw)


def _main(options: dict) -> int:
    lock = threading.Lock()
    # A snapshot is sealed on a thread of its own, in Python: at the default 5 ms switch interval the frame loop
    # would wait up to that long for the interpreter at every frame, and fall behind the engine while it seals.
    sys.setswitchinterval(0.0002)

    def make_ring(opts: dict, header: fmt.Header) -> SegmentRing:
        ring = SegmentRing(opts["path"], header, size=opts["ring_size"], chunk_bytes=opts["chunk_bytes"],
                           flush_interval=opts["flush_interval"], level=opts["level"])
        start_control(ring, lock)
        return ring

    return serve(options, make_ring, lock)


if __name__ == "__main__":
    sys.exit(_main(json.loads(sys.argv[1])))
