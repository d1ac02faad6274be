"""Speculative decoding as the step contracts show it: drafts a step verified and how many of them it accepted.

vLLM schedules a request's draft tokens (`SchedulerOutput.scheduled_spec_decode_tokens`, proposed after the step
before by ngram, EAGLE, MTP or a draft model) next to its one regular token; the rejection sampler keeps the
drafts up to the first rejected one and adds one token of its own (the bonus token when every draft is accepted,
the target's replacement at the first rejection). So a request that verified k drafts emits 1..k+1 tokens, and
`accepted = emitted - 1`, as vLLM's scheduler counts it in `update_from_output`.
"""

from __future__ import annotations

import msgspec

from replay.contracts.outputs import ModelRunnerOutput
from replay.contracts.sched_output import SchedulerOutput


class DraftCounts(msgspec.Struct):
    """Draft tokens one step (or a whole capture) verified and accepted."""

    drafted: int = 0  # draft tokens scheduled for verification
    accepted: int = 0  # of those, the ones the rejection sampler kept
    verifying_requests: int = 0  # request-steps that verified at least one draft

    def add(self, other: DraftCounts) -> None:
        """Accumulate another step's counts."""
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.verifying_requests += other.verifying_requests

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted (None when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else None


def accepted_drafts(drafts: list[int], sampled: list[int]) -> int:
    """How many of a request's scheduled `drafts` its step accepted, from what it emitted (`sampled`): all but
    the last emitted token are accepted drafts (none when nothing was emitted: a discarded or partial step)."""
    return min(max(len(sampled) - 1, 0), len(drafts))


def draft_counts(so: SchedulerOutput, mro: ModelRunnerOutput | None) -> DraftCounts:
    """Drafts `so` scheduled and how many the step's output (`mro`) accepted."""
    out = DraftCounts()
    for rid, drafts in so.scheduled_spec_decode_tokens.items():
        if not drafts:
            continue
        out.drafted += len(drafts)
        out.verifying_requests += 1
        if mro is not None:
            out.accepted += accepted_drafts(drafts, mro.sampled(rid))
    return out
