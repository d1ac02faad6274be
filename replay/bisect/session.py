"""What a session that re-executes step S of a capture many ways (another batch, hooks on every module, a planted
fault) is, on either runner: `Run` (one re-execution's outputs), `Session` (the step, its request ids, the step
with requests left out) and `padded` (the step with one-token requests added). The runners' own sessions are
`builtin_session.StepSession` and `vllm_session.VllmStepSession`; `open_session.make_session` picks one."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import torch
from msgspec.structs import replace

from replay.capture import CaptureReader, Header, Keyframe, RequestAdded, Step
from replay.capture.reading.keyframe_seek import chunks_from
from replay.contracts import GrammarOutput, ModelRunnerOutput, NewRequestData, SamplingParams, SchedulerOutput
from replay.contracts.lora import lora_fields
from replay.errors import CaptureDamagedError, UsageError
from replay.inspect.response_ids import response_prompts
from replay.provenance import HeaderDifference
from replay.replayer.start import Start, clear_of, records_from, start_at
from replay.replayer.swap import Swap

PAD_BLOCKS = 64  # spare KV blocks for padding requests (batch-size experiments)


@dataclass(slots=True)
class Run:
    """One re-execution of the step: the outputs, and the requested request's logits row."""

    logits: torch.Tensor | None  # [vocab] float32 logits of the watched request
    token: list[int]
    modules: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # (module name, output rows), in order
    gathered: set[str] = field(default_factory=set)  # modules put together from tensor-parallel shards
    output: ModelRunnerOutput | None = None  # the whole step's output (every request's tokens and logprobs)


class Session:
    """What both runners' sessions share: the step, and the request ids in it."""

    path: str
    header: Header
    target: int  # the step, S
    step: Step
    start: Start  # where the replay to S starts
    live: set[str]  # requests live at that keyframe (none from step 0)
    ext: dict[str, str]
    internal: dict[str, str]
    notes: list[str]
    differences: list[HeaderDifference]  # the recording's header against the replay's, every field that differs
    vocab_size: int
    runner_kind = "builtin"
    max_padding = PAD_BLOCKS  # padding requests a run can add to the watched request

    def request_id(self, name: str) -> str:
        """Internal id of a request given by its external or internal id, checked to be in the step."""
        rid = self.internal.get(response_request(name, self.internal), name)
        if rid not in self.step.scheduler_output.num_scheduled_tokens:
            raise not_scheduled(name, self.step.index, self.names(self.step.scheduler_output.num_scheduled_tokens))
        return rid

    def names(self, ids: Iterable[str]) -> list[str]:
        """External ids of internal ids."""
        return [self.ext.get(r, r) for r in ids]

    def started(self, start: Start, rebuilt: Iterable[str]) -> None:
        """Say where the replay to the step started, and which requests carry K/V rebuilt there."""
        if start.keyframe is None:
            if start.why:  # (step 0 where a keyframe would have done but for the watched request's neighbours)
                self.notes.append(f"replayed from step 0: {start.why}")
            return
        names = sorted(self.names(rebuilt))
        said = (f"K/V rebuilt there for {', '.join(names[:6])}{', ...' if len(names) > 6 else ''} (a prefill's "
                "numbers, the same in every run)") if names else "no request's K/V rebuilt"
        self.notes.append(f"replayed from the keyframe at step {start.keyframe} ({start.why}); {said}")

    def companions(self, rid: str) -> list[str]:
        """The requests that shared a step with `rid`, at S or before, and can be left out of every step or given
        other content (`co_batched`): those `rid` reads KV blocks of, and those live where the replay starts, cannot;
        the notes say so."""
        return self._companions(rid)[0]

    def kept_as_recorded(self, rid: str) -> list[str]:
        """The requests that shared a step with `rid` and `companions` leaves out (in every run as recorded)."""
        return self._companions(rid)[1]

    def partly_swappable(self, rid: str) -> dict[str, int]:
        """The requests kept because `rid` reads K/V they wrote through the prefix cache, each with how many of its
        leading tokens that K/V holds: the rest of its tokens can be given other content (`Swap`'s `kept`)."""
        return self._companions(rid)[2]

    def swap_candidates(self, rid: str) -> list[str]:
        """The neighbours whose content a swap can change: `companions`, then `partly_swappable`."""
        return self.companions(rid) + list(self.partly_swappable(rid))

    def _companions(self, rid: str) -> tuple[list[str], list[str], dict[str, int]]:
        cache = self.__dict__.setdefault("_companion_cache", {})
        if rid not in cache:
            free, kept, reads = kv_readers(self.path, self.target, rid, self.header.engine_config.block_size,
                                           first=self.start.keyframe or 0)
            if kept:
                self.notes.append(f"kept in every run: {', '.join(self.names(kept))} (request {self.ext.get(rid, rid)} "
                                  "reads KV blocks they wrote, through the prefix cache; a swap gives other content "
                                  "only to their tokens after those)")
            live = [x for x in free if x in self.live]
            if live:
                self.notes.append(f"kept in every run: {', '.join(self.names(live))} (live at the keyframe of step "
                                  f"{self.start.keyframe}, where the replay starts; --from-start can leave them out)")
            cache[rid] = ([x for x in free if x not in self.live], kept + live,
                          {x: n for x, n in reads.items() if x not in self.live})
        return cache[rid]

    def swapper(self, swap: dict[str, str] | None, watch: str | None = None) -> Swap | None:
        """A `Swap` of the requests in `swap` (internal id -> content kind), None for none; those `watch` reads K/V
        of keep the ids of the tokens it reads."""
        if not swap:
            return None
        kept = {x: n for x, n in self.partly_swappable(watch).items() if x in swap} if watch is not None else {}
        return Swap(swap, self.vocab_size, seed=len(swap), kept=kept)

    def without(self, skip: set[str]) -> tuple[SchedulerOutput, GrammarOutput | None]:
        """The step, and its structured-output bitmasks, with the requests in `skip` taken out as if never
        scheduled (`SchedulerOutput.without`)."""
        so, grammar = self.step.scheduler_output, self.step.grammar_output
        if grammar is not None and skip:
            grammar = grammar.without(skip, so.scheduled_spec_decode_tokens)
        return so.without(skip), grammar

    def close(self) -> None:
        """Release the runner (an engine's workers and memory)."""


def start_for(reader: CaptureReader, step: int, watch: str | None, from_start: bool = False) -> Start:
    """Where a session's replay to `step` starts: the nearest keyframe (`start_at`), or, with `watch` (a request its
    runs leave neighbours out of in every step, or swap) where every one of its neighbours at the step is live there,
    the nearest where none of them is live yet (`clear_of`): a run cannot leave out or swap a request the keyframe
    rebuilds, and a bisect that keeps every neighbour tests nothing."""
    start = start_at(reader, step, from_start=from_start)
    if watch is None or start.keyframe is None:
        return start
    ids, found = _names_to(reader, start, step)
    rid = ids.get(response_request(watch, ids), watch)
    if found is None or rid not in found.scheduler_output.num_scheduled_tokens:
        return start  # (the session says what is wrong with the step or the request)
    others = set(found.scheduler_output.num_scheduled_tokens) - {rid}
    return clear_of(reader, start, others, f"request {watch}'s {len(others)} neighbours at step {step}")


def check_target(reader: CaptureReader, start: Start, step: int, request: str | None) -> None:
    """Refuse, before a runner is built for them, a step the capture does not hold and a request (external or internal
    id) not scheduled in it: reads the records from `start` to the step."""
    ids, found = _names_to(reader, start, step)
    if found is None:
        lost = [d for d in reader.damage if d.first_step is not None and d.first_step <= step <= (d.last_step or step)]
        if lost:
            raise CaptureDamagedError(reader.path, f"step {step} is in a damaged part of the capture: "
                                      f"{lost[0].describe()}")
        raise UsageError(f"{reader.path}: no step {step} in this capture")
    scheduled = found.scheduler_output.num_scheduled_tokens
    if request is None or ids.get(response_request(request, ids), request) in scheduled:
        return
    names = {v: k for k, v in ids.items()}
    raise not_scheduled(request, step, [names.get(r, r) for r in scheduled])


def _names_to(reader: CaptureReader, start: Start, step: int) -> tuple[dict[str, str], Step | None]:
    """The requests named from `start` up to step `step` (external id -> internal id: the keyframe's, then each
    arrival), and that step's record (None where the capture has no step `step`)."""
    ids: dict[str, str] = {}
    for rec in records_from(reader, start):
        if isinstance(rec, Keyframe):
            ids.update((x.request.name, x.request.request_id) for x in rec.requests)
        elif isinstance(rec, RequestAdded):
            ids[rec.request.name] = rec.request.request_id
        elif isinstance(rec, Step) and rec.index >= step:
            return ids, rec if rec.index == step else None
    return ids, None


def not_scheduled(name: str, step: int, scheduled: list[str]) -> UsageError:
    """The refusal of request `name` at a step that schedules `scheduled` (external ids) and not it."""
    return UsageError(f"request {name!r} is not scheduled in step {step} (scheduled: {', '.join(scheduled)})"
                      + openai_hint(name, scheduled))


def response_request(name: str, names: Collection[str]) -> str:
    """`name`, or where it is no request of `names` (external ids) but an OpenAI response's id whose response had one
    prompt (`cmpl-X`: its engine's one request `cmpl-X-0`), that request."""
    if name in names:
        return name
    prompts = response_prompts(name, names)
    return prompts[0] if len(prompts) == 1 else name


def openai_hint(name: str, names: Iterable[str]) -> str:
    """'; an OpenAI response's id names ...' where `name` is a response's id (`cmpl-...`) and `names` hold its
    engine's requests `cmpl-...-0`, `-1`, ... (one per prompt); '' otherwise."""
    prompts = [x for x in names if x.startswith(f"{name}-")]
    return (f"; an OpenAI response's id names its prompts' requests {name}-0, {name}-1, ...: {', '.join(prompts[:4])} "
            "here" if prompts else "")


def refuse_crashed(reader: CaptureReader, step: int) -> None:
    """Refuse step `step` where the recording crashed on it: with no output there is nothing to re-execute against
    (`replay run` re-executes the crash and compares what it raises)."""
    found = next(reader.steps(step, step), None)
    if found is not None and found.model_runner_output is None and found.scheduler_output.total_num_scheduled_tokens:
        raise UsageError(f"{reader.path}: step {step} crashed when it was recorded and has no output to bisect; "
                         f"`replay run {reader.path}` re-executes the crash and compares what it raises")


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


def adapters_of(path: str | os.PathLike, ids: Iterable[str], start: Start, last: int) -> dict[str, str]:
    """The LoRA adapter, by name, of each request in `ids` that ran with one: from the keyframe a replay to step
    `last` starts at, and the steps up to `last` that schedule a request for the first time."""
    want, out = set(ids), {}

    def note(rid: str, lora) -> None:
        if rid in want and lora is not None:
            fields = lora_fields(lora)
            out[rid] = fields[0] if fields else "an adapter the capture does not name"

    with CaptureReader(path) as r:
        for rec in records_from(r, start):
            if isinstance(rec, Keyframe):
                for x in rec.requests:
                    note(x.request.request_id, x.request.lora_request)
            elif isinstance(rec, Step):
                if rec.index > last:
                    break
                for n in rec.scheduler_output.scheduled_new_reqs:
                    note(n.req_id, n.lora_request)
    return out


def co_batched(path: str | os.PathLike, last: int, rid: str, block_size: int,
               first: int = 0) -> tuple[list[str], list[str]]:
    """The requests that shared a step with `rid` in steps `first`..`last`, in order of first meeting, as (those
    that can be left out of every step, those that cannot): a request whose KV blocks `rid` hits through the prefix
    cache, or hits through another that does, cannot be, since nothing would then write what `rid` reads."""
    free, kept, _ = kv_readers(path, last, rid, block_size, first)
    return free, kept


def kv_readers(path: str | os.PathLike, last: int, rid: str, block_size: int,
               first: int = 0) -> tuple[list[str], list[str], dict[str, int]]:
    """`co_batched`, and for each request kept that has tokens `rid` does not read: how many of its leading tokens'
    K/V `rid` reads through the prefix cache, directly or through another (the rest of its tokens can be given other
    content, `Swap`'s `kept`)."""
    shared: list[str] = []
    # (KV cache group, block) -> (the request that last wrote it fresh, its index there): each group has its own
    # block ids, so block 7 of one group is not block 7 of another
    writer: dict[tuple[int, int], tuple[str, int]] = {}
    reads: dict[str, dict[str, int]] = {}  # request -> the requests whose blocks it hit -> tokens of theirs read
    length: dict[tuple[str, int], int] = {}  # (request, group) -> blocks in its table
    fed: dict[str, int] = {}  # request -> tokens the runner computed of it up to `last`
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
            new = {n.req_id for n in so.scheduled_new_reqs} | set(cr.resumed_req_ids)
            for q, groups, hits in tables:
                for g, group in enumerate(groups):
                    base = 0 if q in new else length.get((q, g), 0)  # (a running request's new blocks are appended)
                    # a hit block with no writer in the capture was written by nobody we could leave out
                    for b in group[:hits]:
                        w, j = writer.get((g, b), (q, 0))
                        if w != q:
                            seen = reads.setdefault(q, {})
                            seen[w] = max(seen.get(w, 0), (j + 1) * bs)
                    writer.update(((g, b), (q, base + j)) for j, b in enumerate(group) if j >= hits)
                    length[q, g] = base + len(group)
            n = so.num_scheduled_tokens
            fed.update((x.req_id, x.num_computed_tokens + n.get(x.req_id, 0)) for x in so.scheduled_new_reqs)
            fed.update((q, c + n.get(q, 0)) for q, c in zip(cr.req_ids, cr.num_computed_tokens))
            if rid in n:
                shared += [x for x in n if x != rid and x not in shared]
    pinned: dict[str, int] = {}
    todo = [rid]
    while todo:
        for w, n in reads.get(todo.pop(), {}).items():
            if w not in pinned:
                todo.append(w)
            pinned[w] = max(pinned.get(w, 0), n)
    kept = [x for x in shared if x in pinned]
    # one whose every token `rid` reads has no content left to swap
    return [x for x in shared if x not in pinned], kept, {x: pinned[x] for x in kept if pinned[x] < fed.get(x, 0)}
