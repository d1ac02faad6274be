"""Recording: run an engine on a workload with the tap on, into a capture (`replay record`, `replay synth`).

`options` (the engine knobs a user gave, and the one place that turns them into a configuration) ->
`workload` (requests: a prompts file or a synthetic mix) -> `builtin` / `vllm` (the two recorders, sharing
`result`) -> `recorder` (`record`: the command as one call). `tap` streams the builtin engine's steps into a
writer; `synth` writes model-free step streams at production shapes; `stress` runs one prompt many times under
varied co-batching (`replay stress`).
"""

from replay.record.builtin import RecordOptions, record_builtin, run_engine
from replay.record.options import EngineOptions, builtin_config
from replay.record.recorder import default_capture_path, record
from replay.record.result import ProgressBar, RecordResult
from replay.record.tap import CaptureTap, StepListener
from replay.record.workload import (
           SyntheticWorkload,
           WorkloadRequest,
           load_jsonl,
           synthetic,
           workload_requests,
)

__all__ = ["RecordOptions", "record_builtin", "run_engine", "EngineOptions", "builtin_config",
           "default_capture_path", "record", "ProgressBar", "RecordResult", "CaptureTap", "StepListener",
           "SyntheticWorkload", "WorkloadRequest", "load_jsonl", "synthetic", "workload_requests"]
