"""`ShadowTable`: the scheduler's request table as the writer can know it, folded from the records it writes.

The writer sees every arrival, abort and step, which is all a runner ever sees, so it can keep what a runner keeps
(docs/design.md, "The flight recorder") without asking the engine: each live request's tokens, how many of them its KV
blocks hold, its block table, its generator's draws. `keyframe(step)` turns that into a `Keyframe`. Folding follows
vLLM's `GPUModelRunner._update_states` (and our `ModelRunner`): finished requests go first, then new requests, then the
cached requests' diffs (`new_block_ids` appended, or replacing the table for `resumed_req_ids`); the step's output then
adds its sampled tokens.

The runner is never told of a preemption (vLLM 0.32 frees the blocks on the scheduler's side only), so the shadow
learns it from the blocks: a request whose block is handed to another request as a fresh block has lost its K/V.
With prefix caching, the blocks a request leaves behind (finished, preempted) keep their K/V until another request
takes them; the shadow keeps their tokens (`CachedBlocks`) for as long as one of them still holds that content, so
memory stays bounded by the KV cache itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from replay.capture.format.keyframe import CachedBlocks, Keyframe, LiveRequest
from replay.contracts import SAMPLING_EPS, EngineCoreRequest, ModelRunnerOutput, SchedulerOutput


@dataclass(slots=True, eq=False)
class _Writer:
    """Whoever last wrote a set of blocks: a live request, or what a finished or preempted one left behind."""

    prompt: list[int]  # what its blocks were computed from: the prompt, then the outputs
    outputs: list[int]  # (the live request's own list: appending to it costs nothing per step)
    blocks: list[list[int]]  # [groups][blocks]
    kv: int = 0  # tokens whose K/V the blocks hold
    last_step: int = -1

    def tokens(self, n: int) -> list[int]:
        """The first `n` tokens."""
        head = self.prompt[:n]
        return head + self.outputs[: n - len(head)] if len(head) < n else head


@dataclass(slots=True, eq=False)
class _Live:
    request: EngineCoreRequest
    arrived: int
    writer: _Writer = field(default_factory=lambda: _Writer([], [], []))
    outputs: list[int] = field(default_factory=list)
    scheduled: bool = False
    draws: int = 0
    drawn_seed: int | None = None
    preempted: bool = False
    random: bool = False  # a random-sampling request: each step it samples in, its generator draws

    def __post_init__(self) -> None:
        sp = self.request.sampling_params
        self.random = sp is not None and sp.temperature >= SAMPLING_EPS


class ShadowTable:
    """The live requests and the KV blocks' content, as the steps so far left them. `prefix_caching`: keep what
    finished requests leave in their blocks (a later request can hit it); `block_size`: tokens per block."""

    def __init__(self, block_size: int, prefix_caching: bool) -> None:
        self.block_size = max(1, block_size)
        self.prefix_caching = prefix_caching
        self.live: dict[str, _Live] = {}  # internal id -> state, in arrival order
        self.owner: dict[int, _Writer] = {}  # block id -> the writer whose content it holds (group 0's ids)
        self._taken: dict[int, int] = {}  # block id -> the step its owner took it in
        self.left: list[_Writer] = []  # writers no live request is: finished or preempted requests' blocks
        self._kept = 32  # `left` is pruned each time it doubles from what the last pruning kept
        self.next_step = 0  # the step the next record precedes
        self.batch: list[str] = []  # the runner's persistent batch after the last step (its output's req_ids)
        # a ring's triggers, kept only when `watch` is set: requests finished since the last `take_finished`, and
        # the steps whose logprobs held a NaN (or whose logits the engine counted NaNs in)
        self.watch = False
        self.finished: list[str] = []
        self.nonfinite: list[int] = []

    # -- folding --------------------------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, step: int) -> None:
        """A request arrived before step `step`."""
        self.live[request.request_id] = _Live(request, step)

    def abort_request(self, req_id: str) -> None:
        """A client aborted it: a request the runner never saw leaves now (one it saw leaves with finished_req_ids)."""
        st = self.live.get(req_id)
        if st is not None and not st.scheduled:
            del self.live[req_id]

    def knows(self, so: SchedulerOutput) -> bool:
        """Whether every request the step schedules for the first time has its arrival here (else the fold rebuilds
        one from the step's NewRequestData, sampling parameters included)."""
        live = self.live
        return all(new.req_id in live for new in so.scheduled_new_reqs)

    def step(self, index: int, so: SchedulerOutput, out: ModelRunnerOutput | None,
             drawn_seeds: dict[str, int] | None = None) -> None:
        """Fold step `index`: its diff, then its output."""
        self.next_step = index
        for rid in sorted(so.finished_req_ids):  # (sorted: a set's order differs from process to process)
            if self.watch:
                self.finished.append(rid)
            st = self.live.pop(rid, None)
            if st is not None and not st.preempted:
                self._leave(st.writer)
        for rid in sorted(so.preempted_req_ids
                          or ()):  # Model Runner V2 is told; vLLM's v1 runner and ours learn it below
            st = self.live.get(rid)
            if st is not None and not st.preempted:
                st.preempted = True
                st.writer.outputs = list(st.writer.outputs)
                self._leave(st.writer)
        for new in so.scheduled_new_reqs:
            st = self.live.get(new.req_id)
            if st is None:  # scheduled without an arrival record (a tap attached mid-run): what the step says
                st = self.live[new.req_id] = _Live(_arrival(new), index)
            st.scheduled, st.preempted = True, False
            st.outputs = []
            st.writer = _Writer(list(new.prompt_token_ids or ()), st.outputs, [list(g) for g in new.block_ids],
                                new.num_computed_tokens)
            self._take(st.writer, 0, new.num_computed_tokens)
            if drawn_seeds and new.req_id in drawn_seeds:
                st.drawn_seed = drawn_seeds[new.req_id]
        cr = so.scheduled_cached_reqs
        num = len(cr.req_ids)
        if len(cr.new_block_ids) < num or len(cr.num_computed_tokens) < num or 0 < len(cr.num_output_tokens) < num:
            raise ValueError("the step's cached requests' lists are shorter than its req_ids")
        live, resumed = self.live.get, cr.resumed_req_ids
        for rid, blocks, computed, kept in zip(cr.req_ids, cr.new_block_ids, cr.num_computed_tokens,
                                               cr.num_output_tokens or repeat(None)):
            st = live(rid)
            if st is None:
                continue  # a request the shadow never saw scheduled: a runner would refuse the step too
            if kept is not None and kept < len(st.outputs):
                del st.outputs[kept:]
            w = st.writer
            if blocks or resumed and rid in resumed:
                w = self._new_blocks(st, rid in resumed, blocks, computed)
            w.kv = computed
        spec = so.scheduled_spec_decode_tokens
        sampled = dict(zip(out.req_ids, out.sampled_token_ids)) if out is not None else {}
        for rid, n in so.num_scheduled_tokens.items():  # (the writer's hottest loop: one pass per request a step)
            st = live(rid)
            if st is None:
                continue
            w, toks = st.writer, sampled.get(rid)
            if spec and toks and (drafts := len(spec.get(rid, ()))):
                n -= drafts - (len(toks) - 1)  # K/V of rejected drafts is written but never read
            w.kv += n
            w.last_step = index
            if toks:
                st.outputs.extend(toks)
                st.draws += st.random
        self.batch = list(out.req_ids) if out is not None else []
        if self.watch and out is not None and _nonfinite(out):
            self.nonfinite.append(index)
        self.next_step = index + 1

    def _new_blocks(self, st: _Live, resumed: bool, blocks: tuple[list[int], ...] | None, computed: int) -> _Writer:
        """A cached request's new blocks: a new table for a resumed one (the old table's content stays behind for the
        prefix cache), else appended to its table. Returns its writer."""
        w = st.writer
        if resumed:
            if not st.preempted:
                self._leave(w)
            st.writer = w = _Writer(w.prompt, st.outputs, [list(g) for g in blocks] if blocks else [[]], 0,
                                    w.last_step)
            st.preempted = False
            self._take(w, 0, computed)
            return w
        first = len(w.blocks[0]) if w.blocks else 0
        if not w.blocks:
            w.blocks = [[] for _ in blocks]
        for g, ids in zip(w.blocks, blocks):
            g.extend(ids)
        self._take(w, first, computed)
        return w

    def take_finished(self) -> list[str]:
        """The requests finished since the last call."""
        out, self.finished = self.finished, []
        return out

    def _take(self, w: _Writer, first: int, computed: int) -> None:
        """`w` holds its blocks from `first` on. A block that held another writer's content, and was not handed
        over as a prefix-cache hit (block j holding computed tokens), leaves that writer without its K/V there,
        unless that writer took it as a hit in this same step (vLLM caches a block when it allocates it, so a request
        can hit a block another computes in the same step)."""
        if not w.blocks:
            return
        now = self.next_step
        for j in range(first, len(w.blocks[0])):
            b = w.blocks[0][j]
            prev = self.owner.get(b)
            shared = prev is not None and self._taken.get(b) == now
            self.owner[b] = w
            self._taken[b] = now
            if prev is None or prev is w or shared or (j + 1) * self.block_size <= computed:
                continue  # fresh, a prefix hit on the same content, or a hit on what it computes now
            for st in self.live.values():  # a live request lost a block: it was preempted
                if st.writer is prev and not st.preempted:
                    st.preempted = True  # its writer is what it left behind (a copy of its outputs: they go on)
                    prev.outputs = list(prev.outputs)
                    self._leave(prev)
                    break

    def _leave(self, w: _Writer) -> None:
        """A writer is no live request's any more: keep its blocks' content if a later prefix hit can read it (the
        blocks it still holds stay its own), else forget it."""
        if self.prefix_caching and w.kv >= self.block_size and w.blocks and w.blocks[0]:
            self.left.append(w)
            if len(self.left) >= 2 * self._kept:
                self._prune()
            return
        for b in (w.blocks[0] if w.blocks else ()):
            if self.owner.get(b) is w:
                del self.owner[b]
                self._taken.pop(b, None)

    # -- the keyframe ---------------------------------------------------------------------------------------------

    def keyframe(self) -> Keyframe:
        """The state before `next_step`, as a record. Drops what no block holds any more."""
        requests = []
        for st in self.live.values():
            w = st.writer
            requests.append(LiveRequest(st.request, st.arrived, st.scheduled, list(st.outputs),
                                        0 if st.preempted else w.kv,
                                        [list(g) for g in w.blocks] if st.scheduled and not st.preempted else [],
                                        st.draws,
                                        st.drawn_seed, st.preempted))
        return Keyframe(self.next_step, requests, self._cached(), self.block_size,
                        [r for r in self.batch if r in self.live])

    def _held(self, w: _Writer) -> int:
        """How many of `w`'s leading blocks to rebuild: up to the last whole block that still holds its content."""
        whole = w.kv // self.block_size
        held = [j for j, b in enumerate(w.blocks[0][:whole]) if self.owner.get(b) is w]
        return held[-1] + 1 if held else 0

    def _prune(self) -> None:
        """Forget what no block holds any more (its blocks all went to later writers)."""
        self.left = [w for w in self.left if self._held(w)]
        self._kept = max(32, len(self.left))

    def _cached(self) -> list[CachedBlocks]:
        """The content left behind that a block still holds, oldest writer first, cut after its last such block."""
        self._prune()
        out = []
        for w in self.left:
            n = self._held(w)
            out.append(CachedBlocks(w.tokens(n * self.block_size), [g[:n] for g in w.blocks], w.last_step))
        out.sort(key=lambda c: c.last_step)
        return out


def _arrival(new) -> EngineCoreRequest:
    """An arrival rebuilt from a step's NewRequestData, for a request scheduled without one."""
    return EngineCoreRequest(new.req_id, new.prompt_token_ids, None, new.sampling_params, None, 0.0, None, None, None)


def _nonfinite(out: ModelRunnerOutput) -> bool:
    """Whether a step's output shows NaNs: counted in the logits by the engine, or in its logprobs."""
    if out.num_nans_in_logits and any(out.num_nans_in_logits.values()):
        return True
    lp = out.logprobs
    return lp is not None and bool(np.isnan(lp.logprobs.to_numpy()).any())
