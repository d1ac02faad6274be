"""`run_facts`: one pass over a capture for the report's run section: a few numbers per step (batch, prefill and
decode tokens, schedule / execute / update time, preemptions, prefix-cache hits) and a few per request (arrival,
prompt, tokens, the steps that scheduled it, how it ended).

It has to be fast on a 100,000-step capture of 256 running requests (25 million step x request pairs), so it does
not decode what it does not show: a step's ModelRunnerOutput is read only for its request ids and sampled tokens,
never its logprobs (`StepHead`), request ids stay the capture's int handles, and per-request work is numpy over
handles or set arithmetic on who entered and left the batch. The numbers are those of
`replay.inspect.step_summary` (prefill tokens, preemptions inferred from resumptions, finish reasons), computed
column-wise. Nothing per (step, request) is kept: a request's steps are runs of consecutive steps (`spans`).
Steps are numbered by position (0..n-1); `index` maps a position to the engine's step index.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import msgspec
import numpy as np

from replay.capture import CaptureReader, Damage, Header
from replay.capture.codec.columns import ColumnSource
from replay.capture.format import records as fmt
from replay.capture.format.peek import is_unknown_tag
from replay.contracts import SamplingParams
from replay.contracts.image_decoder import ImageDecoder
from replay.inspect.step_summary import StepSummarizer, prefill_tokens
from replay.report.heads import DECODER, OutputHead, StepHead, image_head

# the per-step numbers kept, in the order of `RunFacts.series`
SERIES = ("requests", "prefill", "decode", "schedule_ns", "execute_ns", "update_ns", "preempted", "prefix_hits",
          "new", "finished")
UNFINISHED, FINISHED, ABORTED = 0, 1, 2


@dataclass(slots=True)
class RequestFacts:
    """What the run did with one request (internal id `rid`, shown as `name`: its external id)."""

    rid: str
    name: str
    arrival: int | None = None  # the step it could first be scheduled in (RequestAdded.step)
    prompt_len: int | None = None
    first: int | None = None  # positions of the first and last steps that scheduled it
    last: int | None = None
    tokens: int = 0  # sampled
    preemptions: int = 0
    cached: int = 0  # prompt tokens found in the prefix cache when first scheduled
    status: str = "unfinished"  # finished | aborted | finished (inferred) | unfinished
    spans: list[list[int]] = field(default_factory=list)  # [first, last] positions of each run of steps


@dataclass(slots=True)
class RunFacts:
    """The run section's data: provenance, per-step series (numpy, by position) and per-request facts."""

    path: str
    header: Header
    status: str  # the footer's, or "unfinished"
    damage: list[Damage]
    index: np.ndarray  # position -> step index
    series: dict[str, np.ndarray]  # name (SERIES) -> value per position
    timed: int  # steps that recorded their timing
    requests: dict[str, RequestFacts]  # internal id -> facts, arrivals first (in order), then the others
    crashes: list[tuple[int, str]]  # (step index, "Type: message")

    def position(self, step: int) -> int:
        """The position of engine step `step` (the nearest one at or after it when it is missing)."""
        return int(min(np.searchsorted(self.index, step), max(len(self.index) - 1, 0)))


class _Scan:
    """The pass's state: per-step lists, and per-request numpy columns indexed by id handle."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = list(ids)  # handle -> internal id
        self._handles: dict[str, int] | None = None  # internal id -> handle, for steps stored as images
        self.cols: dict[str, list[int]] = {name: [] for name in SERIES}
        self.index: list[int] = []
        self.timed = 0
        n = max(1024, len(ids))
        self.gen, self.prompt = np.zeros(n, np.int64), np.full(n, -1, np.int64)
        self.status, self.preempt = np.zeros(n, np.int8), np.zeros(n, np.int64)
        self.cached, self.last_tok = np.zeros(n, np.int64), np.full(n, -1, np.int64)
        self.spans: dict[int, list[list[int]]] = {}
        self.running: set[int] = set()  # scheduled in the previous step
        self.marked: set[int] = set()  # recorded as preempted and not back yet
        self.params: dict[int, SamplingParams] = {}
        self.added: dict[str, fmt.RequestAdded] = {}
        self.aborted: list[str] = []
        self.crashes: list[tuple[int, str]] = []
        self.output: OutputHead | None = None  # the last step's output

    def grow(self, need: int) -> None:
        """Make the per-request columns hold handle `need - 1`."""
        if need <= len(self.gen):
            return
        n = max(need, 2 * len(self.gen))
        for name, fill in (("gen", 0), ("prompt", -1), ("status", 0), ("preempt", 0), ("cached", 0), ("last_tok", -1)):
            old = getattr(self, name)
            new = np.full(n, fill, old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)

    def handle(self, req_id: str) -> int:
        """The handle of an internal id (steps stored as images name requests by id): the index's, else a new one."""
        if self._handles is None:
            self._handles = {s: h for h, s in enumerate(self.ids) if s}
        h = self._handles.get(req_id)
        if h is None:
            h = self._handles[req_id] = len(self.ids)
            self.ids.append(req_id)
            self.grow(len(self.ids))
        return h

    def declare_live(self, rec: fmt.LiveIds) -> None:
        """A 1.5 chunk's live handles, declared again: the same names as before, or the first this scan meets
        (the chunk was read on its own)."""
        for h, s in zip(rec.handles, rec.ids):
            self.declare(fmt.Ids(h, [s]))

    def declare(self, rec: fmt.Ids) -> None:
        """Handles `rec.first...` name these internal ids (in-band; the same as the index's)."""
        end = rec.first + len(rec.ids)
        if end > len(self.ids):
            self.ids += [""] * (end - len(self.ids))
        self.ids[rec.first:end] = rec.ids
        if self._handles is not None:
            self._handles.update((s, h) for h, s in enumerate(rec.ids, rec.first))
        self.grow(end)

    def step(self, rec: StepHead) -> None:
        """One step's numbers, and what it did to each request."""
        so, out, pos = rec.scheduler_output, rec.model_runner_output, len(self.index)
        self.index.append(rec.index)
        nst = so.num_scheduled_tokens
        new = hits = 0
        resumed = set(so.scheduled_cached_reqs.resumed_req_ids)
        prefill = 0
        for n in so.scheduled_new_reqs:  # a handful per step: one at a time
            h = n.req_id
            if self.prompt[h] < 0 and n.prompt_token_ids is not None:
                self.prompt[h] = len(n.prompt_token_ids)
            elif self.prompt[h] < 0 and n.prompt_embeds is not None and n.prompt_embeds.shape:
                self.prompt[h] = n.prompt_embeds.shape[0]
            if n.sampling_params is not None:
                self.params.setdefault(h, n.sampling_params)
            if h in self.spans:  # scheduled before: Model Runner V2 sends a resumed request as new again
                resumed.add(h)
            else:
                new += 1
                if n.num_computed_tokens > 0:  # its first blocks were already in the prefix cache
                    hits += 1
                    self.cached[h] = n.num_computed_tokens
            pl = int(self.prompt[h])
            prefill += prefill_tokens(nst.get(h, 0), n.num_computed_tokens, pl if pl >= 0 else None, int(self.gen[h]))
        c = so.scheduled_cached_reqs
        if c.req_ids:
            h = np.asarray(c.req_ids, np.int64)
            n = np.fromiter(map(nst.get, c.req_ids, [0] * len(c.req_ids)), np.int64, len(c.req_ids))
            comp = np.zeros(len(h), np.int64)
            comp[:len(c.num_computed_tokens)] = c.num_computed_tokens[:len(h)]
            outs = (np.asarray(c.num_output_tokens, np.int64) if len(c.num_output_tokens) == len(h)
                    else self.gen[h])
            prefill += int(_prefill_np(n, comp, self.prompt[h], outs).sum())
        # preemptions: recorded (Model Runner V2), else inferred from a resumption
        pre = [(h, pos) for h in (so.preempted_req_ids or ()) if h not in self.marked]
        self.marked |= set(so.preempted_req_ids or ())
        for h in resumed:
            if h not in self.marked and h in self.spans:  # preempted right after the last step that ran it
                pre.append((h, min(self.spans[h][-1][1] + 1, pos)))
            self.marked.discard(h)
        preempted_now = 0
        for h, at in pre:
            self.preempt[h] += 1
            if at < pos:
                self.cols["preempted"][at] += 1
            else:
                preempted_now += 1
        self._batch(pos, set(nst))
        for h in so.finished_req_ids:
            if h < len(self.status) and self.status[h] == UNFINISHED:
                self.status[h] = FINISHED
        if out is not None and out.req_ids:
            h = np.asarray(out.req_ids, np.int64)
            self.gen[h] += np.fromiter(map(len, out.sampled_token_ids), np.int64, len(h))
            self.output = out
        t = rec.timing if rec.timing is not None and rec.timing.start_ns > 0 else None
        self.timed += t is not None
        total = so.total_num_scheduled_tokens
        for name, v in (("requests", len(nst)), ("prefill", prefill), ("decode", total - prefill),
                        ("schedule_ns", t.schedule_ns if t else 0), ("execute_ns", t.execute_ns if t else 0),
                        ("update_ns", t.update_ns if t else 0), ("preempted", preempted_now),
                        ("prefix_hits", hits), ("new", new), ("finished", len(so.finished_req_ids))):
            self.cols[name].append(v)

    def _batch(self, pos: int, now: set[int]) -> None:
        """Who entered and left the batch: their runs of steps (spans) open and close."""
        for h in now - self.running:
            self.spans.setdefault(h, []).append([pos, pos])
        left = self.running - now
        for h in left:
            self.spans[h][-1][1] = pos - 1
        if left:
            self.keep_last_tokens(left)
        self.running = now

    def keep_last_tokens(self, hs: set[int]) -> None:
        """The last token each of `hs` sampled, from the last output (they leave the batch, or the run ends): what
        tells whether a request the capture never reports finished had in fact finished."""
        if self.output is None:
            return
        last = {h: t[-1] for h, t in zip(self.output.req_ids, self.output.sampled_token_ids) if t and h in hs}
        if last:
            self.last_tok[np.fromiter(last, np.int64, len(last))] = list(last.values())

    def facts(self, path: str, header: Header, status: str, damage: list[Damage]) -> RunFacts:
        """The RunFacts of what was scanned."""
        for h in self.running:  # still in the batch at the end
            self.spans[h][-1][1] = len(self.index) - 1
        self.keep_last_tokens(self.running)
        handle = {rid: h for h, rid in enumerate(self.ids) if rid}
        order = list(self.added) + [rid for rid in self.ids if rid and rid not in self.added]
        reqs: dict[str, RequestFacts] = {}
        ended = StepSummarizer()  # its finish_reason: the rule for a request whose finish no step reported
        for rid in order:
            a, h = self.added.get(rid), handle.get(rid)
            f = reqs[rid] = RequestFacts(rid, a.request.name if a else rid)
            if a is not None:
                f.arrival = a.step
                if a.request.prompt_token_ids is not None:
                    f.prompt_len = len(a.request.prompt_token_ids)
            if h is None or h not in self.spans:
                continue
            f.spans = self.spans[h]
            f.first, f.last, f.tokens = f.spans[0][0], f.spans[-1][1], int(self.gen[h])
            f.preemptions, f.cached = int(self.preempt[h]), int(self.cached[h])
            f.prompt_len = f.prompt_len if f.prompt_len is not None else (int(self.prompt[h]) if self.prompt[h] >= 0
                                                                            else None)
            f.status = "finished" if self.status[h] == FINISHED else "unfinished"
            sp = self.params.get(h) or (a.request.sampling_params if a is not None else None)
            if f.status == "unfinished" and sp is not None and self.last_tok[h] >= 0:
                ended.params[rid], ended.generated[rid], ended.last_token[rid] = sp, f.tokens, int(self.last_tok[h])
                if ended.finish_reason(rid) is not None:
                    f.status = "finished (inferred)"  # its finish would be reported by a step the capture lacks
        for rid in self.aborted:
            if rid in reqs:
                reqs[rid].status = "aborted"
        series = {name: np.asarray(v, dtype=np.int64) for name, v in self.cols.items()}
        return RunFacts(path, header, status, damage, np.asarray(self.index, np.int64), series, self.timed, reqs,
                        self.crashes)


def _prefill_np(n: np.ndarray, computed: np.ndarray, prompt_len: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """`prefill_tokens` over arrays: the newest output token is the decode input; every position before it not
    yet computed is prompt, or output recomputed after a preemption (prompt length -1: unknown)."""
    known = prompt_len >= 0
    end = np.where(outputs == 0, np.where(known, prompt_len, computed + n),
                   np.where(known, prompt_len + outputs - 1, computed + n - 1))
    return np.clip(np.minimum(n, end - computed), 0, None)


def run_facts(path: str | os.PathLike) -> RunFacts:
    """Read every readable record of the capture at `path` once and keep the report's run data."""
    status = "unfinished"
    saw_footer = False
    with CaptureReader(path) as r:
        scan = _Scan(r.index.ids if r.index is not None else [])
        images = ImageDecoder()
        damage: list[Damage] = []
        for ref, data, e in r.chunk_bytes():
            try:
                raws = fmt.CHUNK_DECODER.decode(data) if e is None else None
            except msgspec.DecodeError as bad:
                e = bad
            if e is not None:
                damage.append(Damage.chunk_lost(ref.number, ref.offset, ref.info, getattr(e, "reason", str(e))))
                continue
            columns = None  # the chunk's logprob columns: image steps' sampled tokens may be there
            for raw in raws:
                try:
                    rec = DECODER.decode(raw)
                except msgspec.DecodeError as e:
                    if not is_unknown_tag(raw):  # a newer record kind is skipped; anything else is damage
                        damage.append(Damage("record", f"malformed record ({e})", chunk=ref.number, offset=ref.offset))
                    continue
                if isinstance(rec, StepHead):
                    try:
                        scan.step(rec.unpack())
                    except (IndexError, KeyError) as e:  # handles declared in a lost chunk
                        damage.append(Damage("record", f"step {rec.index} refers to what a lost chunk held ({e})",
                                             chunk=ref.number, offset=ref.offset, first_step=rec.index,
                                             last_step=rec.index))
                elif isinstance(rec, fmt.LogprobColumns):
                    columns = ColumnSource(rec)
                elif isinstance(rec, fmt.StepImage):
                    try:
                        scan.step(image_head(rec, images, columns, scan.handle))
                    except (ValueError, msgspec.MsgspecError) as e:
                        damage.append(Damage("record", f"step {rec.index} has inconsistent contents ({e})",
                                             chunk=ref.number, offset=ref.offset, first_step=rec.index,
                                             last_step=rec.index))
                elif isinstance(rec, fmt.Ids):
                    scan.declare(rec)
                elif isinstance(rec, fmt.LiveIds):  # (1.5: the same handles again, as the chunk began)
                    scan.declare_live(rec)
                elif isinstance(rec, fmt.RequestAdded):
                    scan.added.setdefault(rec.request.request_id, rec)
                    scan.handle(rec.request.request_id)  # the writer gives handles in arrival order too
                elif isinstance(rec, fmt.RequestAborted):
                    scan.aborted.append(rec.request_id)
                elif isinstance(rec, fmt.Crash):
                    scan.crashes.append((rec.step, rec.describe()))
                elif isinstance(rec, fmt.Footer):
                    status, saw_footer = rec.status, True
        header = r.header
        damage = list(r.damage) + damage
        if not saw_footer and r.index is None:
            damage.append(Damage("unfinished", "capture was not closed (the recording stopped): records of its last "
                                 "open chunk are lost"))
    return scan.facts(str(path), header, status, damage)
