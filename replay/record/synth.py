"""`synth`: model-free step streams, realistic `SchedulerOutput` / `ModelRunnerOutput`s with no engine behind them
(`replay synth`). Not a workload for `replay record` (that is `shape.SyntheticWorkload`).

It exists to exercise and measure the capture layer at production shapes (hundreds of running requests, top-k
logprobs, churn of finishing and arriving requests, chunked prefills) where running a real model would take hours.
Token ids follow a Zipf law over a permuted vocabulary and logprobs are random float32 values, so their bytes are
as incompressible as real ones. Everything is drawn from one seeded numpy Generator.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from replay.contracts import (
    Array,
    CachedRequestData,
    EngineCoreRequest,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)


@dataclass(slots=True)
class SynthShape:
    """Shape of a synthetic step stream."""

    steps: int = 200
    running: int = 256  # requests decoding concurrently in steady state
    num_logprobs: int | None = 5  # top-k logprobs per sampled token; None = no logprobs
    prompt_len: tuple[int, int] = (64, 1024)  # uniform range of prompt lengths
    output_len: tuple[int, int] = (64, 2048)  # uniform range of output lengths
    vocab_size: int = 128_256
    block_size: int = 16
    max_num_batched_tokens: int = 8192  # prefills beyond this are chunked
    greedy_fraction: float = 0.7  # the rest sample at temperature 0.8 with a seed
    seed: int = 0


@dataclass(slots=True)
class _Req:
    req_id: str
    prompt_len: int
    output_len: int
    blocks: list[int]
    prompt: list[int]
    params: SamplingParams
    num_computed: int = 0
    num_output: int = 0
    scheduled_before: bool = False


@dataclass(slots=True)
class SynthEvent:
    """One engine event: an arrival (`request`) or a step (`scheduler_output` + `model_runner_output`)."""

    step: int
    request: EngineCoreRequest | None = None
    scheduler_output: SchedulerOutput | None = None
    model_runner_output: ModelRunnerOutput | None = None
    extra: dict = field(default_factory=dict)


def synth_events(w: SynthShape) -> Iterator[SynthEvent]:
    """Yield arrivals and steps of a synthetic run, in engine order."""
    rng = np.random.default_rng(w.seed)
    perm = rng.permutation(w.vocab_size)
    running: list[_Req] = []
    next_block = 0
    finished: set[str] = set()
    counter = 0

    def zipf_tokens(n: int) -> np.ndarray:
        z = rng.zipf(1.07, size=n)
        return perm[np.minimum(z - 1, w.vocab_size - 1)]

    def new_request(step: int) -> tuple[_Req, EngineCoreRequest]:
        nonlocal counter
        counter += 1
        rid = f"cmpl-{rng.bytes(16).hex()}-0"
        plen = int(rng.integers(*w.prompt_len, endpoint=True))
        olen = int(rng.integers(*w.output_len, endpoint=True))
        greedy = rng.random() < w.greedy_fraction
        sp = SamplingParams(temperature=0.0 if greedy else 0.8, max_tokens=olen, logprobs=w.num_logprobs,
                            ignore_eos=True, seed=None if greedy else int(rng.integers(1 << 31)))
        req = EngineCoreRequest(rid, zipf_tokens(plen).tolist(), None, sp, None, 1.7e9 + step * 0.02, None, None, None,
                                external_req_id=f"req-{counter}")
        return _Req(rid, plen, olen, [], req.prompt_token_ids, sp), req

    for step in range(w.steps):
        budget = w.max_num_batched_tokens
        new_reqs: list[NewRequestData] = []
        arrivals: list[tuple[_Req, EngineCoreRequest]] = []
        while len(running) + len(arrivals) < w.running:
            arrivals.append(new_request(step))
        for r, req in arrivals:
            yield SynthEvent(step, request=req)
            running.append(r)
        cached_ids, cached_resumed, cached_blocks, cached_computed, cached_out = [], set(), [], [], []
        num_sched: dict[str, int] = {}
        for r in running:
            remaining_prompt = r.prompt_len - r.num_computed
            n = min(remaining_prompt, budget) if remaining_prompt > 0 else 1
            if n <= 0 or budget <= 0:
                continue
            budget -= n
            need = -(-(r.num_computed + n) // w.block_size) - len(r.blocks)
            fresh = list(range(next_block, next_block + max(need, 0)))
            next_block += len(fresh)
            r.blocks.extend(fresh)
            num_sched[r.req_id] = n
            if not r.scheduled_before:
                new_reqs.append(NewRequestData(r.req_id, r.prompt, [], r.params, None, (list(r.blocks),),
                                               r.num_computed, None))
                r.scheduled_before = True
            else:
                cached_ids.append(r.req_id)
                cached_blocks.append((fresh,) if fresh else None)
                cached_computed.append(r.num_computed)
                cached_out.append(r.num_output)
            r.num_computed += n
        so = SchedulerOutput(
            new_reqs,
            CachedRequestData(cached_ids, cached_resumed, [], {}, cached_blocks, cached_computed, cached_out),
            num_sched,
            sum(num_sched.values()),
            {},
            {},
            finished,
            [],
        )
        finished = set()
        ids = list(num_sched)
        sampled: list[list[int]] = []
        by_id = {r.req_id: r for r in running}
        for rid in ids:
            r = by_id[rid]
            if r.num_computed >= r.prompt_len:
                sampled.append([int(zipf_tokens(1)[0])])
                r.num_output += 1
            else:
                sampled.append([])  # partial prefill chunk: nothing sampled
        lp = None
        if w.num_logprobs is not None:
            lp = _logprobs(rng, zipf_tokens, sampled, [by_id[rid].params.temperature == 0.0 for rid in ids],
                           w.num_logprobs)
        mro = ModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)}, sampled, lp)
        yield SynthEvent(step, scheduler_output=so, model_runner_output=mro)
        still = []
        for r in running:
            if r.num_output >= r.output_len:
                finished.add(r.req_id)
            else:
                still.append(r)
        running = still



def _logprobs(rng, zipf_tokens, sampled: list[list[int]], greedy: list[bool], k: int) -> LogprobsLists:
    """vLLM's columns: column 0 the sampled token, columns 1..k the top-k by value, plus the sampled token's rank.
    A greedy token is the top-1 (rank 1); a random one has a geometric rank and sits in the top-k when rank <= k."""
    n = len(sampled)
    tok = zipf_tokens(n * (k + 1)).reshape(n, k + 1).astype(np.int32)
    vals = np.empty((n, k + 1), dtype=np.float32)
    vals[:, 1:] = -np.sort(rng.exponential(3.0, size=(n, k)).astype(np.float32), axis=1)
    ranks = np.where(greedy, 1, rng.geometric(0.5, size=n)).astype(np.int64)
    for i, s in enumerate(sampled):
        r = int(ranks[i])
        if r <= k:
            tok[i, r] = tok[i, 0] = s[0] if s else tok[i, r]
            vals[i, 0] = vals[i, r]
        else:
            if s:
                tok[i, 0] = s[0]
            vals[i, 0] = vals[i, k] - np.float32(rng.exponential(1.0))
    return LogprobsLists(Array.from_numpy(tok), Array.from_numpy(vals), Array.from_numpy(ranks))


def record_synth(path: str | os.PathLike, shape: SynthShape, *, overwrite: bool = False,
                 **writer_options: Any) -> Path:
    """Write a synthetic step stream of `shape` into a capture at `path`; returns the final path."""
    from replay.capture import CaptureWriter, EngineConfig
    from replay.provenance import make_header

    header = make_header(
        "synthetic",
        engine_config=EngineConfig(block_size=shape.block_size, max_num_seqs=shape.running,
                                   max_num_batched_tokens=shape.max_num_batched_tokens,
                                   enable_chunked_prefill=True, seed=shape.seed),
        extra={"workload": {f: getattr(shape, f) for f in SynthShape.__slots__}},
    )
    with CaptureWriter(path, header, overwrite=overwrite, **writer_options) as w:
        for ev in synth_events(shape):
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
            else:
                w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
    return w.path
