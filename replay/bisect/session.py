"""Sessions that re-execute step S of a capture many ways (another batch, hooks on every module, a planted fault):
`StepSession` on the builtin runner, from a snapshot of its state just before S (steps 0..S-1 replay once), and
`make_session`, which picks it or vLLM's (`replay.bisect.vllm_session`) by the `runner` knob."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from msgspec.structs import replace

from replay.capture import CaptureReader, Step
from replay.contracts import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from replay.errors import UsageError
from replay.replayer import Plant, StepLoop, build_runner
from replay.replayer.plant import install

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

    def close(self) -> None:
        """Release the runner (an engine's workers and memory)."""


def make_session(path: str | os.PathLike, step: int, overrides: dict[str, str] | None = None, *,
                 force: bool = False, log: Callable[[str], None] | None = None) -> Session:
    """A session on the runner the `runner` knob names (builtin by default)."""
    if (overrides or {}).get("runner") == "vllm":
        from replay.bisect.vllm_session import VllmStepSession

        return VllmStepSession(path, step, overrides, force=force, log=log)
    return StepSession(path, step, overrides, force=force, log=log)


class StepSession(Session):
    """Replays a capture (forced mode) on the builtin runner up to step `step`, then re-executes that step on demand
    from a snapshot."""

    def __init__(self, path: str | os.PathLike, step: int, overrides: dict[str, str] | None = None, *,
                 force: bool = False, log: Callable[[str], None] | None = None) -> None:
        self.path = str(path)
        self.log = log or (lambda msg: None)
        with CaptureReader(path) as r:
            self.header = r.header
            built = build_runner(r.header, overrides or {}, force=force, extra_blocks=PAD_BLOCKS)
            self.runner = built.builtin("bisecting a step")
            self.notes = built.notes
            loop = StepLoop(path, self.runner)
            for rec, _ in loop.replay(r.records(), until=step):
                if rec.index % 50 == 0:
                    self.log(f"  replaying to step {step}: at {rec.index}")
        if loop.next_step is None:
            raise UsageError(f"{path}: no step {step} in this capture")
        self.step = loop.next_step
        self.ext, self.internal = loop.external, loop.internal
        self.prev = loop.sampled
        self.snap = self.runner.snapshot()
        self.num_blocks = self.runner.kv.num_blocks

    def neighbours(self, rid: str) -> list[str]:
        """The requests co-scheduled with `rid` at the step."""
        return [r for r in self.step.scheduler_output.num_scheduled_tokens if r != rid]

    def run(self, watch: str, keep: set[str] | None = None, pad: int = 0,
            hooks: list[Callable[[], Any]] | None = None, modules: bool = False, plant: Plant | None = None) -> Run:
        """Re-execute the step from the snapshot with only `keep` (None: everyone) plus `pad` one-token padding
        requests, and `plant`'s fault; return `watch`'s logits (and every module's output rows for it, with
        `modules`)."""
        self.runner.restore(self.snap)
        so = self.step.scheduler_output if keep is None else subset(self.step.scheduler_output, keep)
        if pad:
            so = padded(so, pad, range(self.num_blocks - PAD_BLOCKS, self.num_blocks))
        if plant is not None:
            hooks = [lambda: install(plant, self.runner, watch), *(hooks or [])]
        self.runner.update_states(so, self.step.drawn_seeds, self.prev)
        captured: list[tuple[str, torch.Tensor]] = []
        handles = []
        model = self.runner.model
        runner = self.runner

        def rows(name, out):
            if not isinstance(out, torch.Tensor):
                return
            flat = out.reshape(out.shape[0], -1)
            if name == "lm_head":
                i = runner.current_rows.index(watch)
                captured.append((name, flat[i:i + 1].detach().cpu().clone()))
            elif name and watch in runner.current_spans:
                a, b = runner.current_spans[watch]
                captured.append((name, flat[a:b].detach().cpu().clone()))

        handles += [h() for h in (hooks or [])]  # first: the capture hooks below must see what these did
        if modules:
            for name, m in model.named_modules():
                if name:
                    handles.append(m.register_forward_hook(lambda mod, args, out, name=name: rows(name, out)))
        else:
            handles.append(model.lm_head.register_forward_hook(lambda mod, args, out: rows("lm_head", out)))
        try:
            mro = self.runner.run_step(so, self.step.grammar_output)
        finally:
            for h in handles:
                h.remove()
        logits = next((t[0].float() for n, t in captured if n == "lm_head"), None)
        return Run(logits, mro.sampled(watch), captured if modules else [])


def subset(so: SchedulerOutput, keep: set[str]) -> SchedulerOutput:
    """The step with only the requests in `keep`, each with its recorded number of scheduled tokens."""
    cr = so.scheduled_cached_reqs
    idx = [i for i, r in enumerate(cr.req_ids) if r in keep]
    pick = lambda xs: [xs[i] for i in idx] if xs else xs  # noqa: E731
    cached = CachedRequestData(pick(cr.req_ids), {r for r in cr.resumed_req_ids if r in keep}, pick(cr.new_token_ids),
                               {k: v for k, v in cr.all_token_ids.items() if k in keep}, pick(cr.new_block_ids),
                               pick(cr.num_computed_tokens), pick(cr.num_output_tokens))
    sched = {r: n for r, n in so.num_scheduled_tokens.items() if r in keep}
    return replace(so, scheduled_new_reqs=[n for n in so.scheduled_new_reqs if n.req_id in keep],
                   scheduled_cached_reqs=cached, num_scheduled_tokens=sched, total_num_scheduled_tokens=sum(sched.values()))


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
