"""Inspecting a capture: `info` (what it holds, how big, what is damaged), `show` (steps as a human reads them),
`export` (every record as JSON lines, or a timeline for Perfetto and chrome://tracing). `replay recover` lives with
the file format, in `replay.capture.reading.recover`."""

from replay.inspect.export import export_records
from replay.inspect.info import CaptureInfo, capture_info
from replay.inspect.perfetto import export_perfetto, perfetto_trace
from replay.inspect.show import ShownSteps, show_steps

__all__ = ["export_records", "CaptureInfo", "capture_info", "export_perfetto", "perfetto_trace", "ShownSteps",
           "show_steps"]
