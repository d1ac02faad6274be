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

from replay.bisect.session import Run, Session, padded
from replay.capture import CaptureReader, EngineConfig, Step
from replay.capture.reading.keyframe_seek import chunks_from
from replay.errors import CannotTestError, UsageError
from replay.integrations.vllm.engines import Engines
from replay.integrations.vllm.layout import recorded_layout
from replay.integrations.vllm.taps import LOGITS
from replay.replayer import Plant, StepLoop, build_runner
from replay.replayer.start import loop_from, start_at

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
    step 0, on the same engine)."""

    runner_kind = "vllm"

    def __init__(self, path: str | os.PathLike, step: int, overrides: dict[str, str] | None = None, *,
                 force: bool = False, log: Callable[[str], None] | None = None, from_start: bool = False,
                 engines: Engines | None = None) -> None:
        self.path = str(path)
        self.target = step
        self.log = log or (lambda msg: None)
        overrides = {**(overrides or {}), "runner": "vllm"}
        with CaptureReader(path) as r:
            self.header = header = r.header
            self.start = start_at(r, step, from_start=from_start)
        overrides, eager_note = eager(header.engine_config, overrides)
        self.log(f"starting vLLM's runner for {path}")
        built = build_runner(header, overrides, force=force, capture=path, engines=engines)
        self.runner = built.runner
        self.notes = eager_note + built.notes
        try:
            loop = self._replay(set())
        except BaseException:
            self.runner.close()
            raise
        self.step: Step = loop.next_step
        self.ext, self.internal = loop.external, loop.internal
        self._live = {x.request.request_id for x in loop.priming.keyframe.requests} if loop.priming else set()
        self.started(self.start, loop.priming.rebuilt if loop.priming else ())
        self._fresh = True  # the engine stands just before step S with nobody left out
        self._neighbours: dict[str, list[str]] = {}
        # the persistent batch holds max_num_seqs rows: the watched request and its padding must fit
        self.max_padding = max(min(int(header.engine_config.max_num_seqs or 16) - 1,
                                   self.runner.num_blocks - 1 - len(self._blocks)), 0)

    def _replay(self, skip: set[str]) -> StepLoop:
        """The steps before S on a reset engine, from the session's start, `skip` left out of each; the loop stops
        before S."""
        self.runner.reset()
        self._blocks: set[int] = set()
        with CaptureReader(self.path) as r:
            loop, records = loop_from(r, self.runner, self.start, skip=skip)
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
        """The requests that shared a step with `rid`, at S or before, and can be left out (`co_batched`); those
        `rid` reads KV blocks of are kept in every run, and the notes say so."""
        if rid not in self._neighbours:
            free, kept = co_batched(self.path, self.target, rid, self.header.engine_config.block_size,
                                    first=self.start.keyframe or 0)
            if kept:
                self.notes.append(f"kept in every run: {', '.join(self.names(kept))} (request {self.ext.get(rid, rid)} "
                                  "reads KV blocks they wrote, through the prefix cache)")
            live = [x for x in free if x in self._live]
            if live:
                self.notes.append(f"kept in every run: {', '.join(self.names(live))} (live at the keyframe of step "
                                  f"{self.start.keyframe}, where the replay starts; --from-start can leave them out)")
            self._neighbours[rid] = [x for x in free if x not in self._live]
        return self._neighbours[rid]

    def run(self, watch: str, keep: set[str] | None = None, pad: int = 0,
            hooks: list[Callable[[], Any]] | None = None, modules: bool = False, plant: Plant | None = None) -> Run:
        """Replay steps 0..S with only `keep` of `watch`'s neighbours (None: everyone) in every step, plus `pad`
        one-token padding requests at S, and `plant`'s fault at S; return `watch`'s logits (and every module's output
        rows for it, with `modules`)."""
        if hooks:
            raise UsageError("hooks are builtin-runner callables; on vLLM's runner plant a fault with --plant")
        skip = set() if keep is None else set(self.neighbours(watch)) - set(keep)
        if not (self._fresh and not skip):
            self.log(f"replaying steps 0-{self.target} on vLLM's runner" + (f", {len(skip)} neighbours left out"
                                                                              if skip else ""))
            self._replay(skip)
        self._fresh = False
        so, grammar = self.without(skip)
        if pad:
            spare = (b for b in range(self.runner.num_blocks - 1, 0, -1) if b not in self._blocks)
            so = padded(so, pad, spare)
        self.runner.update_states(so, self.step.drawn_seeds, self._sampled)
        self.runner.start_taps(watch, modules, (plant.module, plant.size) if plant is not None else None)
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
                   {m.name for m in rows if m.gathered})

    def close(self) -> None:
        """Shut the engine down."""
        self.runner.close()


def co_batched(path: str | os.PathLike, last: int, rid: str, block_size: int,
               first: int = 0) -> tuple[list[str], list[str]]:
    """The requests that shared a step with `rid` in steps `first`..`last`, in order of first meeting, as (those
    that can be left out of every step, those that cannot): a request whose KV blocks `rid` hits through the prefix
    cache, or hits through another that does, cannot be, since nothing would then write what `rid` reads."""
    shared: list[str] = []
    writer: dict[int, str] = {}  # KV block -> the request that last wrote it fresh
    reads: dict[str, set[str]] = {}  # request -> the requests whose blocks it hit
    bs = max(block_size, 1)
    with CaptureReader(path) as r:
        for rec in r.records(chunks=chunks_from(r, first)) if first and r.index is not None else r.records():
            if isinstance(rec, Step) and rec.index > last:
                break
            if not isinstance(rec, Step) or rec.index < first:
                continue
            so = rec.scheduler_output
            cr = so.scheduled_cached_reqs
            # (request, block table groups, full blocks it found computed): new and resumed requests bring whole
            # tables that start with their prefix hits; a running request's new blocks are all fresh
            tables = [(n.req_id, n.block_ids, n.num_computed_tokens // bs) for n in so.scheduled_new_reqs]
            tables += [(q, g, cr.num_computed_tokens[i] // bs if q in cr.resumed_req_ids else 0)
                       for i, (q, g) in enumerate(zip(cr.req_ids, cr.new_block_ids)) if g]
            for q, groups, hits in tables:
                for group in groups:
                    # a hit block with no writer in the capture was written by nobody we could leave out
                    reads.setdefault(q, set()).update(writer[b] for b in group[:hits] if writer.get(b, q) != q)
                    writer.update((b, q) for b in group[hits:])
            if rid in so.num_scheduled_tokens:
                shared += [x for x in so.num_scheduled_tokens if x != rid and x not in shared]
    pinned: set[str] = set()
    todo = [rid]
    while todo:
        for w in reads.get(todo.pop(), ()):
            if w not in pinned:
                pinned.add(w)
                todo.append(w)
    return [x for x in shared if x not in pinned], [x for x in shared if x in pinned]
