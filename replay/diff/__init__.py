"""Diffing: `rules` (tolerances, compared numbers, flip classes; each defined once) -> `step` (a replayed step
against its recording: `replay run --diff`) and `captures` (two recordings request by request: `replay diff`)."""

from replay.diff.captures import CaptureDiff, TokenMismatch, diff_captures
from replay.diff.rules import DEFAULT_TIE_MARGIN, Tolerance, classify
from replay.diff.step import (
           BatchComposition,
           Divergence,
           StepSummary,
           batch_composition,
           compare_step,
)

__all__ = ["CaptureDiff", "TokenMismatch", "diff_captures", "DEFAULT_TIE_MARGIN", "Tolerance", "classify",
           "BatchComposition", "Divergence", "StepSummary", "batch_composition", "compare_step"]
