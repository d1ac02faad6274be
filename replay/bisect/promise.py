"""Whether a recording or its replay promises bitwise repeats: then a replay that does not repeat itself is a bug,
not noise. Two settings promise it: our batch-invariant mode (`batch_invariant`, in the recording's engine config
or `--set`), and vLLM's `VLLM_BATCH_INVARIANT=1` (in the recording's environment or `--set env.`)."""

from __future__ import annotations

import os

from replay.capture import CaptureReader

ON = ("1", "true")


def determinism_promise(path: str | os.PathLike, overrides: dict[str, str] | None = None) -> str:
    """What promises bitwise repeats here, in words ("" when nothing does)."""
    overrides = overrides or {}
    with CaptureReader(path) as r:
        h = r.header
    if overrides.get("batch_invariant", "").lower() in ON:
        return "--set batch_invariant=true"
    if overrides.get("env.VLLM_BATCH_INVARIANT", "").lower() in ON:
        return "--set env.VLLM_BATCH_INVARIANT=1"
    if getattr(h.engine_config, "batch_invariant", False) and "batch_invariant" not in overrides:
        return "the recording's batch-invariant mode"
    if h.environment.env.get("VLLM_BATCH_INVARIANT", "0").lower() in ON and \
            "env.VLLM_BATCH_INVARIANT" not in overrides:
        return "the recording's VLLM_BATCH_INVARIANT=1"
    return ""


def promise_clause(promise: str) -> str:
    """The verdict's last words on a replay that does not repeat itself."""
    if promise:
        return f"; {promise} promises bitwise repeats, so this is a bug"
    return "; nothing here promises bitwise repeats (batch-invariant mode would), so it is noise, not a bug"
