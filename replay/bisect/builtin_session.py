"""`StepSession`: step S of a capture re-executed many ways on the builtin runner, each time from a snapshot of the
runner's state just before S (the steps before S replay once, from the nearest keyframe or step 0)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from replay.bisect.session import PAD_BLOCKS, Run, Session, padded, refuse_crashed, start_for
from replay.capture import CaptureReader
from replay.errors import UsageError
from replay.replayer import Plant, build_runner
from replay.replayer.loop import StepLoop
from replay.replayer.plant import install
from replay.replayer.start import loop_from
from replay.replayer.swap import Swap


class StepSession(Session):
    """Replays a capture (forced mode) on the builtin runner up to step `step`, then re-executes that step on demand
    from a snapshot. `watch`: a request whose neighbours runs leave out of, or swap in, every step (`start_for`)."""

    def __init__(self, path: str | os.PathLike, step: int, overrides: dict[str, str] | None = None, *,
                 force: bool = False, log: Callable[[str], None] | None = None, from_start: bool = False,
                 watch: str | None = None) -> None:
        self.path = str(path)
        self.target = step
        self.log = log or (lambda msg: None)
        with CaptureReader(path) as r:
            self.header = r.header
            self.start = start_for(r, step, watch, from_start)
            refuse_crashed(r, step)
            built = build_runner(r.header, overrides or {}, force=force, extra_blocks=PAD_BLOCKS)
            self.runner = built.builtin("bisecting a step")
            self.notes = built.notes
            self.differences = built.differences
        self.vocab_size = self.runner.vocab_size
        self.empty = self.runner.snapshot(kv=False)  # where a replay with other content starts over
        loop = self._replay(None)
        self.step = loop.next_step
        self.ext, self.internal = loop.external, loop.internal
        self.live = {x.request.request_id for x in loop.priming.keyframe.requests if x.scheduled} \
            if loop.priming else set()  # (a request still waiting there is first scheduled after it)
        self.started(self.start, loop.priming.rebuilt if loop.priming else ())
        self.prev = loop.sampled
        self.snap = self.runner.snapshot()
        self.num_blocks = self.runner.kv.num_blocks

    def _replay(self, swap: Swap | None, skip: set[str] = frozenset()) -> StepLoop:
        """The steps before S from the session's start, `swap`'s requests with other content, `skip` left out of
        each; stops before S."""
        with CaptureReader(self.path) as r:
            loop, records = loop_from(r, self.runner, self.start, skip=skip)
            loop.swap = swap
            for rec, _ in loop.replay(records, until=self.target):
                if rec.index % 50 == 0:
                    self.log(f"  replaying to step {self.target}: at {rec.index}")
        if loop.next_step is None:
            raise UsageError(f"{self.path}: no step {self.target} in this capture")
        return loop

    def neighbours(self, rid: str) -> list[str]:
        """The requests co-scheduled with `rid` at the step."""
        return [r for r in self.step.scheduler_output.num_scheduled_tokens if r != rid]

    def run(self, watch: str, keep: set[str] | None = None, pad: int = 0,
            hooks: list[Callable[[], Any]] | None = None, modules: bool = False, plant: Plant | None = None,
            swap: dict[str, str] | None = None, throughout: bool = False) -> Run:
        """Re-execute the step from the snapshot with only `keep` (None: everyone) plus `pad` one-token padding
        requests, and `plant`'s fault; with `swap` (internal id -> content kind), replay to the step again with those
        requests' tokens swapped for others of the same shapes; with `throughout`, replay to it again with `keep`'s
        complement among `watch`'s `companions` left out of every step (as vLLM's runner always does). Return
        `watch`'s logits (and every module's output rows for it, with `modules`)."""
        swapper = self.swapper(swap, watch)
        prev = self.prev
        skip = set(self.companions(watch)) - keep if throughout and keep is not None else set()
        if swapper or skip:
            self.runner.restore(self.empty)
            prev = self._replay(swapper, skip).sampled
        else:
            self.runner.restore(self.snap)
        so, grammar = self.without(set() if keep is None
                                   else set(self.step.scheduler_output.num_scheduled_tokens) - keep)
        if swapper:
            so = swapper.step(so)
        if pad:
            so = padded(so, pad, range(self.num_blocks - PAD_BLOCKS, self.num_blocks))
        if plant is not None:
            resolved = plant.resolved(self.internal)
            hooks = [lambda: install(resolved, self.runner, watch), *(hooks or [])]
        self.runner.update_states(so, self.step.drawn_seeds, prev)
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
            mro = self.runner.run_step(so, grammar)
        finally:
            for h in handles:
                h.remove()
        logits = next((t[0].float() for n, t in captured if n == "lm_head"), None)
        return Run(logits, mro.sampled(watch), captured if modules else [], output=mro)
