"""What a session that re-executes step S of a capture many ways (another batch, hooks on every module, a planted
fault) is, on either runner: `Run` (one re-execution's outputs), `Session` (the step, its request ids, the step
with requests left out) and `padded` (the step with one-token requests added). The runners' own sessions are
`builtin_session.StepSession` and `vllm_session.VllmStepSession`; `open_session.make_session` picks one."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from msgspec.structs import replace

from replay.capture import Step
from replay.contracts import GrammarOutput, NewRequestData, SamplingParams, SchedulerOutput
from replay.errors import UsageError
from replay.replayer.start import Start

PAD_BLOCKS = 64  # spare KV blocks for padding requests (batch-size experiments)


@dataclass(slots=True)
class Run:
    """One re-execution of the step: the outputs, and the requested request's logits row."""

    logits: torch.Tensor | None  # [vocab] float32 logits of the watched request
    token: list[int]
    modules: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # (module name, output rows), in order
    gathered: set[str] = field(default_factory=set)  # modules put together from tensor-parallel shards


class Session:
    """What both runners' sessions share: the step, and the request ids in it."""

    path: str
    step: Step
    ext: dict[str, str]
    internal: dict[str, str]
    notes: list[str]
    runner_kind = "builtin"
    max_padding = PAD_BLOCKS  # padding requests a run can add to the watched request

    def request_id(self, name: str) -> str:
        """Internal id of a request given by its external or internal id, checked to be in the step."""
        rid = self.internal.get(name, name)
        if rid not in self.step.scheduler_output.num_scheduled_tokens:
            raise UsageError(f"request {name!r} is not scheduled in step {self.step.index} "
                             f"(scheduled: {', '.join(self.names(self.step.scheduler_output.num_scheduled_tokens))})")
        return rid

    def names(self, ids: Iterable[str]) -> list[str]:
        """External ids of internal ids."""
        return [self.ext.get(r, r) for r in ids]

    def started(self, start: Start, rebuilt: Iterable[str]) -> None:
        """Say where the replay to the step started, and which requests carry K/V rebuilt there."""
        if start.keyframe is None:
            return
        names = sorted(self.names(rebuilt))
        said = (f"K/V rebuilt there for {', '.join(names[:6])}{', ...' if len(names) > 6 else ''} (a prefill's "
                "numbers, the same in every run)") if names else "no request's K/V rebuilt"
        self.notes.append(f"replayed from the keyframe at step {start.keyframe} ({start.why}); {said}")

    def without(self, skip: set[str]) -> tuple[SchedulerOutput, GrammarOutput | None]:
        """The step, and its structured-output bitmasks, with the requests in `skip` taken out as if never
        scheduled (`SchedulerOutput.without`)."""
        so, grammar = self.step.scheduler_output, self.step.grammar_output
        if grammar is not None and skip:
            grammar = grammar.without(skip, so.scheduled_spec_decode_tokens)
        return so.without(skip), grammar

    def close(self) -> None:
        """Release the runner (an engine's workers and memory)."""


def padded(so: SchedulerOutput, k: int, spare: Iterable[int]) -> SchedulerOutput:
    """The step plus `k` new one-token requests, one in each of the first `k` `spare` blocks (blocks no request
    holds): they only change the batch's size."""
    blocks = list(spare)[:k]
    if k > len(blocks):
        raise UsageError(f"at most {len(blocks)} padding requests here (spare KV blocks)")
    pads = [NewRequestData(f"__pad{i}", [3 + i], [], SamplingParams(temperature=0.0), None, ([b],), 0, None)
            for i, b in enumerate(blocks)]
    sched = dict(so.num_scheduled_tokens)
    sched.update({p.req_id: 1 for p in pads})
    return replace(so, scheduled_new_reqs=list(so.scheduled_new_reqs) + pads, num_scheduled_tokens=sched,
                   total_num_scheduled_tokens=sum(sched.values()))
