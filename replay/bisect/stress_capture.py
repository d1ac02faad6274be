"""`stress` on a capture: one recorded request, replayed N times from the keyframe nearest its first step to its last
(an earlier one, before they were scheduled, where all its neighbours are live there: no trial can leave out a
request the keyframe rebuilds), each time with another random subset of the neighbours it really had left out of
every step, in free mode (its own tokens fed back). The counts of `stress` on a prompt (unique completions, unique
logprob sequences, where they first fork and the batches there), on the recording's model, layout and traffic, on
either runner."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from msgspec.structs import replace

from replay.bisect.promise import determinism_promise
from replay.bisect.session import co_batched
from replay.capture import CaptureReader, Keyframe, Record, RequestAdded, Step
from replay.errors import UsageError
from replay.integrations.vllm.engines import Engines
from replay.processes.in_environment import applied, in_environment
from replay.record.stress import StressReport, Watch, first_fork
from replay.replayer import build_runner
from replay.replayer.knobs import Knobs, check_overrides, env_knobs
from replay.replayer.start import Start, clear_of, live_at, loop_from, start_at


@dataclass(slots=True)
class _Target:
    """The request a stress replays: its ids, the steps it ran in and what it sampled there."""

    rid: str
    name: str
    first: int = -1  # the step it was first scheduled in (-1: before the capture, live at its first keyframe)
    last: int = -1  # the last step it sampled a token in
    tokens: list[int] = field(default_factory=list)
    logprobs: int | None = None  # the logprobs it asked for


def stress_capture(path: str | os.PathLike, request: str, *, trials: int = 20, seed: int = 0,
                   overrides: Knobs | None = None, runner: str | None = None, force: bool = False,
                   from_start: bool = False, engines: Engines | None = None,
                   log: Callable[[str], None] | None = None) -> StressReport:
    """Replay request `request` (external or internal id) of `path` `trials` times, the first time with every neighbour
    as recorded, then each time with a random subset (drawn from `seed`) of the neighbours it shared a step with left
    out of every step; count the unique completions and logprob sequences it gives. Starts at the keyframe nearest its
    first step unless `from_start`. `overrides`: replay knobs (`dtype`, `env.NAME`...: a dict, "K=V,K=V" or a list);
    `runner="vllm"` (or the knob) for vLLM's runner; `engines`: started vLLM engines to run on (every trial runs on
    one)."""
    overrides = check_overrides(overrides, runner)
    env = env_knobs(overrides)
    if env and not applied(env):
        return in_environment(env, stress_capture, path, request, trials=trials, seed=seed, overrides=overrides,
                              force=force, from_start=from_start)
    if trials < 2:
        raise UsageError("--trials must be at least 2")
    log = log or (lambda msg: None)
    with CaptureReader(path) as r:
        target = _find(r, request)
        start = start_at(r, target.first if target.first >= 0 else None, from_start=from_start)
        header = r.header
        lost = [d.describe() for d in r.damage]
        live = live_at(r, start.keyframe) if start.keyframe is not None else set()
    if target.first < 0 and start.keyframe is None:
        raise UsageError(f"{path}: request {request!r} started before this capture's first step")
    free, kept = co_batched(path, target.last, target.rid, header.engine_config.block_size,
                            first=start.keyframe or 0)
    if free and not set(free) - live:  # every neighbour is rebuilt there: start before they were scheduled
        with CaptureReader(path) as r:
            start = clear_of(r, start, set(free), f"request {target.name}'s {len(free)} neighbours")
            live = live_at(r, start.keyframe) if start.keyframe is not None else set()
        free, kept = co_batched(path, target.last, target.rid, header.engine_config.block_size,
                                first=start.keyframe or 0)
    neighbours = [x for x in free if x not in live]
    if not neighbours:
        raise UsageError(f"{path}: request {request!r} shared no step with a neighbour that can be left out "
                         f"(steps {start.keyframe or 0}-{target.last}"
                         + (f"; {len(free)} were live at the keyframe of step {start.keyframe}" if free else "")
                         + "): nothing to vary")
    rng = random.Random(seed)
    plans = [frozenset()] + [frozenset(rng.sample(neighbours, rng.randint(1, len(neighbours))))
                             for _ in range(trials - 1)]
    before = engines.starts if engines is not None else 0  # (a pool given may have started engines already)
    built = build_runner(header, overrides, force=force, capture=path, engines=engines)
    runner = built.runner
    empty = runner.snapshot(kv=False) if built.kind == "builtin" else None
    runs: list[Watch] = []
    try:
        for i, skip in enumerate(plans):
            if empty is not None:
                runner.restore(empty)
            else:
                runner.reset()
            runs.append(_trial(path, runner, start, target, skip))
            log(f"  trial {i + 1}/{trials}: {len(skip)} of {len(neighbours)} neighbours left out, "
                f"{len(set(b for b, _ in runs[-1].batch))} batch sizes")
    finally:
        runner.close()
    rep = _report(path, target, start, runs, plans, neighbours, kept, live, built.kind, overrides,
                  engines.starts - before if engines is not None else int(built.kind == "vllm"))
    return replace(rep, data_lost=lost)


def _find(reader: CaptureReader, request: str) -> _Target:
    """The request named `request` (its external or internal id): its steps and what it sampled."""
    target: _Target | None = None
    for rec in reader.records():
        if target is None:
            if isinstance(rec, RequestAdded) and request in (rec.request.name, rec.request.request_id):
                target = _Target(rec.request.request_id, rec.request.name)
            elif isinstance(rec, Keyframe):
                found = next((x for x in rec.requests if request in (x.request.name, x.request.request_id)), None)
                if found is not None:
                    target = _Target(found.request.request_id, found.request.name)
            continue
        if not isinstance(rec, Step):
            continue
        so, out = rec.scheduler_output, rec.model_runner_output
        if target.first < 0 and any(n.req_id == target.rid for n in so.scheduled_new_reqs):
            target.first = rec.index
            n = next(n for n in so.scheduled_new_reqs if n.req_id == target.rid)
            target.logprobs = n.sampling_params.logprobs if n.sampling_params is not None else None
        if out is not None and target.rid in out.req_id_to_index:
            toks = out.sampled_token_ids[out.req_id_to_index[target.rid]]
            if toks:
                target.tokens += toks
                target.last = rec.index
    if target is None:
        raise UsageError(f"{reader.path}: no request {request!r} in this capture")
    if target.last < 0:
        raise UsageError(f"{reader.path}: request {request!r} sampled no token in this capture")
    return target


def _trial(path: str | os.PathLike, runner, start: Start, target: _Target, skip: frozenset[str]) -> Watch:
    """One replay of the window, `skip` left out of every step, free mode: the target's tokens and batches."""
    watch = Watch(target.rid, [], [], [])
    with CaptureReader(path) as r:
        loop, records = loop_from(r, runner, start, mode="free", skip=skip)
        for step, out in loop.replay(_with_logprobs(records, target), last=target.last):
            watch.on_step(step.index, step.scheduler_output, out)
    return watch


def _with_logprobs(records: Iterator[Record], target: _Target) -> Iterator[Record]:
    """The records, the target asking for the sampled token's logprob where it asked for none (its numbers are
    what the trials compare; a request's logprobs never change what it samples)."""
    if target.logprobs is not None:
        yield from records
        return
    for rec in records:
        if isinstance(rec, Step) and any(n.req_id == target.rid for n in rec.scheduler_output.scheduled_new_reqs):
            so = rec.scheduler_output
            new = [replace(n, sampling_params=replace(n.sampling_params, logprobs=0))
                   if n.req_id == target.rid and n.sampling_params is not None else n for n in so.scheduled_new_reqs]
            rec = replace(rec, scheduler_output=replace(so, scheduled_new_reqs=new))
        elif isinstance(rec, Keyframe):
            reqs = [replace(x, request=replace(x.request, sampling_params=replace(x.request.sampling_params,
                                                                                  logprobs=0)))
                    if x.request.request_id == target.rid and x.request.sampling_params is not None else x
                    for x in rec.requests]
            rec = replace(rec, requests=reqs)
        yield rec


def _report(path, target: _Target, start: Start, runs: list[Watch], plans: list[frozenset[str]],
            neighbours: list[str], kept: list[str], live: set[str], kind: str, overrides: dict[str, str],
            starts: int) -> StressReport:
    completions = {tuple(w.tokens) for w in runs}
    sequences = {tuple(w.logprobs) for w in runs}
    fork = first_fork(runs)
    promise = determinism_promise(path, overrides)
    window = f"steps {start.keyframe or 0}-{target.last}"
    where = "vLLM's" if kind == "vllm" else "the builtin"
    verdict = (f"{len(runs)} replays of request {target.name} ({window}) on {where} runner, each leaving out another "
               f"random subset of its {len(neighbours)} neighbours: {len(completions)} unique completion(s), "
               f"{len(sequences)} unique logprob sequence(s)")
    if fork is not None:
        verdict += f"; they first fork at output position {fork.position} ({fork.kind}s differ)"
    notes = []
    if start.keyframe is not None:
        notes.append(f"replayed from the keyframe at step {start.keyframe} ({start.why})")
    elif start.why:
        notes.append(f"replayed from step 0: {start.why}")
    if target.first < 0:  # (else it starts at or after the keyframe, and nothing of it is rebuilt)
        notes.append(f"request {target.name} was running at that keyframe: its K/V there is rebuilt, the same in "
                     "every trial")
    if kept:
        notes.append(f"kept in every trial: {len(kept)} whose KV blocks it reads through the prefix cache")
    held = sorted(live - {target.rid})
    if held:
        notes.append(f"kept in every trial: {len(held)} running at the keyframe (--from-start can leave them out)")
    same = runs[0].tokens == target.tokens[-len(runs[0].tokens):] if runs[0].tokens else False
    notes.append("trial 0 (every neighbour, as recorded) " + ("samples the recorded completion" if same else
                                                              "samples another completion than the recording's"))
    if target.logprobs is None:
        notes.append(f"request {target.name} asked for no logprobs: the trials computed the sampled token's")
    if promise:
        notes.append(f"{promise} promises bitwise repeats: more than one logprob sequence is a bug")
    return StressReport(len(runs), len(completions), len(sequences), fork, bool(promise), verdict,
                        request=target.name, notes=notes, left_out=[len(p) for p in plans], engine_starts=starts)
