"""`VllmStepSession`: step S re-executed many ways on vLLM's own runner, in every worker (tensor parallelism too).

vLLM's runner state cannot be snapshotted and put back, so each run is a replay up to S in forced mode on one
engine, built once, from the nearest keyframe (else step 0): the engine forgets every request between runs
(`VllmRunner.reset`). Requests left out of a run (`keep`) are left out of every step up to S, which forced mode makes
well defined: the others' steps are the recorded ones, without them; those live at the keyframe cannot be. Bisect
layers compares module outputs, so the runs are eager (hooks do not fire inside a compiled graph); a compiled
recording is replayed eager, and the session's notes say so.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from replay.bisect.session import Run, Session, check_target, padded, refuse_crashed, start_for
from replay.capture import CaptureReader, EngineConfig, Step
from replay.errors import CannotTestError, UsageError
from replay.integrations.vllm.engines import Engines
from replay.integrations.vllm.layout import recorded_layout
from replay.integrations.vllm.taps import LOGITS
from replay.replayer import Plant, StepLoop, build_runner
from replay.replayer.start import loop_from
from replay.replayer.swap import Swap

_TRUE = ("1", "true", "yes", "on")


def eager(ec: EngineConfig, overrides: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The knobs with `enforce_eager=true` where the recording (or a knob) compiled the model, and the note that says
    so: module hooks do not fire inside a compiled graph."""
    if str(recorded_layout(ec, overrides).get("enforce_eager", "True")).lower() in _TRUE:
        return overrides, []
    return {**overrides, "enforce_eager": "true"}, ["compiled in the recording: run eager here (module hooks do not "
                                                    "fire inside a compiled graph)"]


class VllmStepSession(Session):
    """Replays a capture on vLLM's runner up to step `step`, then re-executes that step on demand (each time from
    where the replay starts, on the same engine). `watch`: a request whose neighbours runs leave out, or swap
    (`start_for`); `request`: the one the session is about, refused before the engine starts if the step does not
    schedule it."""

    runner_kind = "vllm"

    def __init__(self, path: str | os.PathLike, step: int, overrides: dict[str, str] | None = None, *,
                 force: bool = False, log: Callable[[str], None] | None = None, from_start: bool = False,
                 engines: Engines | None = None, watch: str | None = None, request: str | None = None) -> None:
        self.path = str(path)
        self.target = step
        self.log = log or (lambda msg: None)
        overrides = {**(overrides or {}), "runner": "vllm"}
        with CaptureReader(path) as r:
            self.header = header = r.header
            self.start = start_for(r, step, watch, from_start)
            refuse_crashed(r, step)
            check_target(r, self.start, step, request)  # (before an engine starts for a step or request not there)
        overrides, eager_note = eager(header.engine_config, overrides)
        self.log(f"starting vLLM's runner for {path}")
        built = build_runner(header, overrides, force=force, capture=path, engines=engines)
        self.runner = built.runner
        self.notes = eager_note + built.notes
        self.differences = built.differences
        self.vocab_size = self.runner.vocab_size
        try:
            loop = self._replay(set())
        except BaseException:
            self.runner.close()
            raise
        self.step: Step = loop.next_step
        self.ext, self.internal = loop.external, loop.internal
        self.live = {x.request.request_id for x in loop.priming.keyframe.requests if x.scheduled} \
            if loop.priming else set()  # (a request still waiting there is first scheduled after it)
        self.started(self.start, loop.priming.rebuilt if loop.priming else ())
        self._fresh = True  # the engine stands just before step S with nobody left out
        # the persistent batch holds max_num_seqs rows: the watched request and its padding must fit
        self.max_padding = max(min(int(header.engine_config.max_num_seqs or 16) - 1,
                                   self.runner.num_blocks - 1 - len(self._blocks)), 0)

    def _replay(self, skip: set[str], swap: Swap | None = None) -> StepLoop:
        """The steps before S on a reset engine, from the session's start, `skip` left out of each, `swap`'s requests
        with other content; the loop stops before S."""
        self.runner.reset()
        self._blocks: set[int] = set()
        with CaptureReader(self.path) as r:
            loop, records = loop_from(r, self.runner, self.start, skip=skip)
            loop.swap = swap
            for rec, _ in loop.replay(records, until=self.target):
                self._note_blocks(rec)
        if loop.priming is not None:  # the blocks the keyframe's requests and prefix cache hold
            kf = loop.priming.keyframe
            for groups in [x.block_ids for x in kf.requests] + [c.block_ids for c in kf.cached]:
                self._blocks.update(b for group in groups for b in group)
        if loop.next_step is None:
            raise UsageError(f"{self.path}: no step {self.target} in this capture")
        self._note_blocks(loop.next_step)
        self._sampled = loop.sampled
        return loop

    def _note_blocks(self, step: Step) -> None:
        """The KV blocks the replay handed out so far (padding requests take others)."""
        so = step.scheduler_output
        for r in so.scheduled_new_reqs:
            self._blocks.update(b for group in r.block_ids for b in group)
        for groups in so.scheduled_cached_reqs.new_block_ids:
            self._blocks.update(b for group in groups or () for b in group)

    def neighbours(self, rid: str) -> list[str]:
        """The requests that shared a step with `rid`, at S or before, and can be left out (`companions`)."""
        return self.companions(rid)

    def run(self, watch: str, keep: set[str] | None = None, pad: int = 0,
            hooks: list[Callable[[], Any]] | None = None, modules: bool = False, plant: Plant | None = None,
            swap: dict[str, str] | None = None, throughout: bool = True) -> Run:
        """Replay steps 0..S with only `keep` of `watch`'s neighbours (None: everyone) in every step, plus `pad`
        one-token padding requests at S, and `plant`'s fault at S, the requests in `swap` (internal id -> content)
        with other tokens of the same shapes; return `watch`'s logits (and every module's output rows for it, with
        `modules`). Requests left out are left out of every step (`throughout` is always so here)."""
        if hooks:
            raise UsageError("hooks are builtin-runner callables; on vLLM's runner plant a fault with --plant")
        skip = set() if keep is None else set(self.neighbours(watch)) - set(keep)
        swapper = self.swapper(swap, watch)
        if not (self._fresh and not skip and not swapper):
            self.log(f"replaying steps {self.start.keyframe or 0}-{self.target} on vLLM's runner"
                     + (f", {len(skip)} neighbours left out" if skip else "")
                     + (f", {len(swap)} with other content" if swapper else ""))
            self._replay(skip, swapper)
        self._fresh = False
        so, grammar = self.without(skip)
        if swapper:
            so = swapper.step(so)
        if pad:
            spare = (b for b in range(self.runner.num_blocks - 1, 0, -1) if b not in self._blocks)
            so = padded(so, pad, spare)
        self.runner.update_states(so, self.step.drawn_seeds, self._sampled)
        self.runner.start_taps(watch, modules, plant.taps(self.internal) if plant is not None else None)
        try:
            mro = self.runner.run_step(so, grammar)
        except BaseException:
            self.runner.finish_taps(check=False)
            raise
        rows = self.runner.finish_taps()
        logits = next((m.rows[0].float() for m in rows if m.name == LOGITS), None)
        if logits is None or (modules and not any(m.name != LOGITS for m in rows)):
            raise CannotTestError(f"no module hook of vLLM's model fired for the request at step {self.target}: "
                                  "its forward ran where hooks cannot see it (a compiled graph?); nothing was compared")
        return Run(logits, mro.sampled(watch), [(m.name, m.rows) for m in rows] if modules else [],
                   {m.name for m in rows if m.gathered}, mro)

    def close(self) -> None:
        """Shut the engine down."""
        self.runner.close()
