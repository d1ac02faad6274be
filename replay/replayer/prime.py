"""Priming a runner from a keyframe (docs/design.md, "The flight recorder"): the K/V a replay from step K needs, rebuilt
before step K runs.

A keyframe lists what filled the KV blocks before step K: the live requests' tokens, and the tokens of blocks that
finished or preempted requests left behind for the prefix cache (oldest first). Each of these *writers* becomes a
pseudo request (`replay-prime:N`, greedy, never compared) that prefills its tokens into its blocks, in chunks of at
most `budget` tokens a step, as the engine's own chunked prefill does. A writer that shares a block with an earlier
one runs after it, so every block ends with its latest content. The pseudo requests are finished, then each live
request is restored in the runner (`Runner.restore_request`: tokens, block table, generator past its draws), and
step K's diff applies as on any step.

The rebuilt K/V is a prefill's, where the recording had decoded it token by token: the same numbers only where the
kernels are batch-invariant. So the requests that read rebuilt blocks (those live at the keyframe, and those that hit
a rebuilt block in the prefix cache) are compared within `REBUILD_TOLERANCE` and named as rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replay.capture import Keyframe
from replay.contracts import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from replay.diff import Tolerance
from replay.replayer.build import Runner

PRIME_PREFIX = "replay-prime:"
MIN_PRIME_BUDGET = 2048  # tokens a priming step prefills at most (or the engine's max_num_batched_tokens, if more)
# How far a rebuilt request's logprobs may move, by the model's dtype: K/V computed by one prefill where the recording
# decoded it token by token. Measured on the builtin engine (tiny model, 23 keyframes of a 177-step capture with
# preemption and prefix hits, 109 rebuilt requests compared over the 30 steps after each): the largest |Δlogprob|
# was 8.1e-6 in float32, 0.015 in float16 and 0.099 in bfloat16 (docs/guide.md, "Replay from a keyframe"); the
# tolerance leaves a margin of 5-12x over it.
REBUILD_ATOL = {"float64": 1e-9, "float32": 1e-4, "float16": 0.1, "bfloat16": 0.5}


def rebuild_tolerance(tol: Tolerance, dtype: str) -> Tolerance:
    """The tolerance rebuilt requests are compared within: `tol`, widened to the rebuild's for `dtype`, the recorded
    one (a replay on another dtype differs by more, and is meant to show it)."""
    return Tolerance(max(tol.atol, REBUILD_ATOL.get(dtype, REBUILD_ATOL["bfloat16"])), tol.rtol, tol.tie_margin)


@dataclass(slots=True)
class _Writer:
    req_id: str
    tokens: list[int]
    blocks: list[list[int]]
    lora_request: object = None
    first: int = -1  # the priming step of its first chunk
    last: int = -1


@dataclass(slots=True)
class Priming:
    """What a replay from a keyframe rebuilt, and how."""

    keyframe: Keyframe
    steps: list[SchedulerOutput] = field(default_factory=list)  # the pseudo requests' prefill steps
    tokens: int = 0  # tokens prefilled
    rebuilt: set[str] = field(default_factory=set)  # live requests whose K/V was rebuilt (internal ids)
    blocks: set[int] = field(default_factory=set)  # blocks holding rebuilt K/V (until a step writes them afresh)

    def note_step(self, so: SchedulerOutput) -> None:
        """Follow a replayed step: a request that hits a rebuilt block reads rebuilt K/V; a block written afresh is
        rebuilt no more."""
        if not self.blocks:
            return
        bs = max(1, self.keyframe.block_size)
        for new in so.scheduled_new_reqs:
            self._take(new.req_id, new.block_ids[0] if new.block_ids else [], new.num_computed_tokens, bs)
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            blocks = cr.new_block_ids[i]
            if blocks and rid in cr.resumed_req_ids:
                self._take(rid, blocks[0], cr.num_computed_tokens[i], bs)
            elif blocks:
                self.blocks.difference_update(blocks[0])

    def _take(self, rid: str, blocks: list[int], computed: int, bs: int) -> None:
        hit = blocks[: computed // bs]
        if any(b in self.blocks for b in hit):
            self.rebuilt.add(rid)
        self.blocks.difference_update(blocks[len(hit):])


def plan_priming(kf: Keyframe, budget: int) -> Priming:
    """The prefill steps that rebuild the keyframe's K/V, `budget` tokens a step at most."""
    budget = max(1, budget)
    writers: list[_Writer] = []
    for i, c in enumerate(kf.cached):
        writers.append(_Writer(f"{PRIME_PREFIX}{i}", c.token_ids, c.block_ids))
    p = Priming(kf)
    for r in kf.requests:
        if r.scheduled and not r.preempted and r.num_computed_tokens > 0 and r.block_ids:
            writers.append(_Writer(f"{PRIME_PREFIX}{r.request.request_id}", r.token_ids[: r.num_computed_tokens],
                                   r.block_ids, r.request.lora_request))
            p.rebuilt.add(r.request.request_id)
    load: list[int] = []  # tokens scheduled per priming step
    last_of_block: dict[int, int] = {}  # block -> the last priming step a writer wrote it in
    chunks: list[list[tuple[_Writer, int, int]]] = []  # per step: (writer, start, count)
    for w in writers:
        step = max((last_of_block.get(b, -1) + 1 for b in w.blocks[0]), default=0)
        start = 0
        while start < len(w.tokens):
            while step < len(load) and load[step] >= budget:
                step += 1
            if step == len(load):
                load.append(0)
                chunks.append([])
            n = min(budget - load[step], len(w.tokens) - start)
            chunks[step].append((w, start, n))
            load[step] += n
            if w.first < 0:
                w.first = step
            w.last = step
            start += n
            step += 1
        for b in w.blocks[0]:
            last_of_block[b] = max(last_of_block.get(b, -1), w.last)
        p.blocks.update(w.blocks[0][: -(-len(w.tokens) // max(1, kf.block_size))])
        p.tokens += len(w.tokens)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    for s, step_chunks in enumerate(chunks + [[]]):  # (the last step only finishes the pseudo requests)
        new, cached = [], CachedRequestData.make_empty()
        scheduled: dict[str, int] = {}
        for w, start, n in step_chunks:
            if start == 0:
                new.append(NewRequestData(w.req_id, w.tokens, [], greedy, None, tuple(w.blocks), 0, w.lora_request))
            else:
                cached.req_ids.append(w.req_id)
                cached.new_block_ids.append(None)
                cached.num_computed_tokens.append(start)
                cached.num_output_tokens.append(0)
            scheduled[w.req_id] = n
        finished = {w.req_id for w in writers if w.last == s - 1}
        p.steps.append(SchedulerOutput(new, cached, scheduled, sum(scheduled.values()), {}, {}, finished, []))
    return p


def prime(runner: Runner, kf: Keyframe, budget: int) -> Priming:
    """Rebuild the keyframe's K/V on `runner` (prefill steps of pseudo requests, then finished), and restore its live
    requests. Returns what was rebuilt."""
    p = plan_priming(kf, budget)
    for so in p.steps:  # (the last schedules nothing: it finishes the pseudo requests, which vLLM's runner must run)
        runner.update_states(so)
        runner.run_step(so)
    runner.restore_requests(kf)
    return p
