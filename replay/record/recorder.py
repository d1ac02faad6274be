"""`record`: `replay record` as one library call. It checks the engine options, then hands the workload to the
builtin recorder or to the vLLM one."""

from __future__ import annotations

import time
from pathlib import Path

from replay.record.options import EngineOptions, builtin_config
from replay.record.result import RecordResult
from replay.record.workload import WorkloadRequest


def default_capture_path(model: str) -> Path:
    """captures/<model>-<time>.capture, where a recording goes when no path is given."""
    stem = Path(model).name if model != "tiny" else "tiny"
    return Path("captures") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.capture"


def record(engine: EngineOptions, requests: list[WorkloadRequest], out: str | Path | None = None, *,
           overwrite: bool = False, progress: bool = False, flush_interval: float | None = None) -> RecordResult:
    """Record `requests` on the engine `engine` describes (its defaults for every knob it leaves unset) into
    `out` (default: `default_capture_path`)."""
    engine.check()
    path = Path(out) if out is not None else default_capture_path(engine.model)
    if engine.engine == "vllm":
        from replay.record.vllm import record_vllm, vllm_record_options

        return record_vllm(vllm_record_options(engine, requests, path, overwrite=overwrite, progress=progress))
    from replay.record.builtin import RecordOptions, record_builtin

    return record_builtin(RecordOptions(builtin_config(engine), requests, path, overwrite=overwrite,
                                        progress=progress, flush_interval=flush_interval))
