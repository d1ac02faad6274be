"""`record`: `replay record` as one library call. It checks the engine options, then hands the workload to the
builtin recorder or to the vLLM one."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from replay.capture.writing.keyframe_maker import KEYFRAME_ENV, keyframe_interval
from replay.errors import UsageError
from replay.record.options import EngineOptions, builtin_config
from replay.record.result import RecordResult
from replay.record.workload import WorkloadRequest, unique_ids


def default_capture_path(model: str) -> Path:
    """captures/<model>-<time>.capture, where a recording goes when no path is given."""
    stem = Path(model).name if model != "tiny" else "tiny"
    return Path("captures") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.capture"


def record(engine: EngineOptions, requests: list[WorkloadRequest], out: str | Path | None = None, *,
           overwrite: bool = False, progress: bool = False, flush_interval: float | None = None,
           keyframe_steps: int | None = None, ring: int | None = None) -> RecordResult:
    """Record `requests` on the engine `engine` describes (its defaults for every knob it leaves unset) into `out`
    (default: `default_capture_path`); a keyframe every `keyframe_steps` steps (default: REPLAY_KEYFRAME_STEPS, else
    `replay.capture.writing.keyframe_maker.DEFAULT_KEYFRAME_STEPS`; 0: none); `ring`: bytes of a ring of segments in the
    directory `out` instead (the builtin engine; vLLM's tap takes REPLAY_CAPTURE_RING)."""
    engine.check()
    unique_ids(requests)
    path = Path(out) if out is not None else default_capture_path(engine.model)
    if engine.engine == "vllm":
        from replay.record.vllm import record_vllm, vllm_record_options

        if ring:
            raise UsageError("--ring records the builtin engine; a vLLM engine records into a ring with "
                             "REPLAY_CAPTURE=DIR REPLAY_CAPTURE_RING=SIZE")
        with _keyframe_env(keyframe_steps):  # the tap's writer process reads it
            return record_vllm(vllm_record_options(engine, requests, path, overwrite=overwrite, progress=progress))
    from replay.record.builtin import RecordOptions, record_builtin

    return record_builtin(RecordOptions(builtin_config(engine), requests, path, overwrite=overwrite,
                                        progress=progress, flush_interval=flush_interval,
                                        keyframe_steps=keyframe_steps, ring=ring))


@contextlib.contextmanager
def _keyframe_env(steps: int | None) -> Iterator[None]:
    """REPLAY_KEYFRAME_STEPS set to `steps` (when given) for the duration."""
    if steps is None:
        yield
        return
    before = os.environ.get(KEYFRAME_ENV)
    os.environ[KEYFRAME_ENV] = str(keyframe_interval(steps))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(KEYFRAME_ENV, None)
        else:
            os.environ[KEYFRAME_ENV] = before
