"""`run_demo`: the main job on the embedded default, end to end (`replay demo`): record the default workload on
`tiny`, summarise the capture, replay it bit for bit, then replay it in bfloat16 to show a divergence report, and
write that report as HTML (`replay report`) to open in a browser."""

from __future__ import annotations

from pathlib import Path

import msgspec

from replay.inspect import CaptureInfo, capture_info
from replay.record import (
    EngineOptions,
    RecordResult,
    SyntheticWorkload,
    record,
    workload_requests,
)
from replay.replayer import ReplayOptions, ReplayReport, replay_capture
from replay.report import KEEP_DIVERGENCES, ReportResult, write_report

DEMO_CAPTURE = Path("captures/demo.capture")


class DemoResult(msgspec.Struct):
    """The five results the demo shows, in order."""

    record: RecordResult
    info: CaptureInfo
    replay: ReplayReport  # as recorded: a bitwise match
    bfloat16: ReplayReport  # --set dtype=bfloat16: a divergence
    report: ReportResult  # the bfloat16 replay's HTML report, beside the capture (NAME.bfloat16.html)


def run_demo(output: str | Path = DEMO_CAPTURE, *, progress: bool = False) -> DemoResult:
    """Record on `tiny` (one thread, the engine's defaults otherwise) into `output`, then inspect and replay it, and
    write the bfloat16 replay's report."""
    engine = EngineOptions(threads=1)
    rec = record(engine, workload_requests(engine.model, None, SyntheticWorkload()), output, overwrite=True,
                 progress=progress)
    bf16 = replay_capture(rec.path, ReplayOptions(overrides={"dtype": "bfloat16"}, max_divergences=KEEP_DIVERGENCES))
    return DemoResult(rec, capture_info(rec.path), replay_capture(rec.path), bf16,
                      write_report(rec.path, Path(rec.path).with_suffix(".bfloat16.html"), replay=bf16))
