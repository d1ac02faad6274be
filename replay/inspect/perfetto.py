"""`perfetto_trace` / `export_perfetto`: a capture as a Chrome trace-event document (JSON Object Format) for
ui.perfetto.dev and chrome://tracing (`replay export --format perfetto`). Times in µs from the earliest event;
every slice is an "X" complete event, so none can be left open.

    pid 1 "engine"    tid 1 "steps": one slice per step, "step N" (cat "step"), holding "schedule", "execute" and
                      "update" (cat "step_phase"). A step that starts before an earlier one ended (vLLM's async
                      scheduling schedules step N+1 while step N executes) goes on tid 2, 3, ... "steps (overlap K)":
                      slices on one thread must nest. "crash: <type>" instants (cat "crash"). Counters (cat
                      "counter") at each step's start: "running requests", "waiting requests", "scheduled tokens".
    pid 2 "requests"  one thread per request, named by its external id, in arrival order: "waiting", "prefill" (one
                      per step that schedules prompt tokens, or recomputes outputs after a preemption), "decode"
                      (consecutive decode steps merged, with a count), "preempted" slices (cat "request"), then a
                      "finished" or "aborted" instant.

Steps carry the engine's monotonic clock (`StepTiming`); steps without timing (synthetic captures) are laid out
back to back, NOMINAL_STEP_NS each, as `metadata.timing` says. Arrivals carry wall-clock time: they are moved onto
the engine's clock by the largest offset that keeps each at or before the step it arrived before.
"""

from __future__ import annotations

import bisect
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import msgspec

from replay.capture import (
    CaptureReader,
    Crash,
    Damage,
    Footer,
    Header,
    RequestAborted,
    RequestAdded,
    Step,
)
from replay.inspect.step_summary import StepSummarizer, StepSummary, infer_preemptions

NOMINAL_STEP_NS = 1_000_000  # the width of a step that has no timing: 1 ms
ENGINE_PID, REQUESTS_PID = 1, 2


@dataclass(slots=True)
class _Track:
    """A request's thread, and where its phase machine stands."""

    tid: int
    rid: str
    state: str = "new"  # new | waiting | preempted | running | done
    since: int = 0  # when the open waiting / preempted phase began (ns)
    cursor: int = 0  # end of its last slice: under async scheduling its steps overlap, its slices must not
    last_end: int | None = None  # end of the last step that scheduled it: when it finished
    run: dict[str, Any] | None = None  # the open decode slice, grown while consecutive steps decode
    generated: int = 0


class _Trace:
    """Builds the events from the summaries, in step order; times in engine-clock ns until `_document`."""

    def __init__(self, steps: list[StepSummary], external: dict[str, str]) -> None:
        self.steps, self.external = steps, external
        self.events: list[dict[str, Any]] = []
        self.tracks: dict[str, _Track] = {}
        self.names: set[str] = set()
        self.states: Counter[str] = Counter()  # requests per state, for the counters (kept, not recounted per step)
        self.lanes = self.untimed = 0
        self.spans = self._place_spans()
        self.end = max((a + d for a, d, _ in self.spans), default=0)

    def _place_spans(self) -> list[tuple[int, int, int]]:
        """(start, duration, lane) of each step: its own timing, or NOMINAL_STEP_NS after the previous one."""
        out, lane_ends, end = [], [], 0
        for s in self.steps:
            t = s.timing
            if t is not None:
                start, dur = t.start_ns, t.schedule_ns + t.execute_ns + t.update_ns
            else:
                start, dur = end, NOMINAL_STEP_NS
                self.untimed += 1
            lane = next((k for k, e in enumerate(lane_ends) if e <= start), len(lane_ends))
            lane_ends[lane:lane + 1] = [start + dur]
            end = max(end, start + dur)
            out.append((start, dur, lane))
        self.lanes = max(1, len(lane_ends))
        return out

    # -- requests ------------------------------------------------------------------------------------------------

    def move(self, tr: _Track, state: str, since: int = 0) -> None:
        """Put the request in `state` (which began at `since`, for waiting and preempted)."""
        self.states[tr.state] -= 1
        self.states[state] += 1
        tr.state, tr.since = state, since

    def track(self, rid: str) -> _Track:
        """The request's track, made (and named) on first sight: at its arrival, or when first scheduled."""
        tr = self.tracks.get(rid)
        if tr is None:
            name = self.external.get(rid) or rid
            name = name if name not in self.names else f"{name} ({rid})"  # two requests, one client id
            self.names.add(name)
            tr = self.tracks[rid] = _Track(len(self.tracks) + 1, rid)
            self.states["new"] += 1
            self.meta(REQUESTS_PID, tr.tid, "thread_name", name)
            self.meta(REQUESTS_PID, tr.tid, "thread_sort_index", tr.tid)
        return tr

    def slice(self, tr: _Track, name: str, start: int, end: int, args: dict[str, Any]) -> None:
        """A phase on the request's thread, moved past its previous one where async steps overlap."""
        start = max(start, tr.cursor)
        end = max(end, start)
        self.events.append({"name": name, "cat": "request", "ph": "X", "pid": REQUESTS_PID, "tid": tr.tid,
                            "ts": start, "dur": end - start, "args": {"request_id": tr.rid, **args}})
        tr.cursor = end

    def instant(self, pid: int, tid: int, name: str, cat: str, ts: int, args: dict[str, Any]) -> None:
        """A thread-scoped instant event."""
        self.events.append({"name": name, "cat": cat, "ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": ts,
                            "args": args})

    def close_wait(self, tr: _Track, at: int) -> None:
        """End an open waiting or preempted phase at `at`."""
        if tr.state in ("waiting", "preempted"):
            self.slice(tr, tr.state, tr.since, at, {})

    def flush(self, tr: _Track) -> None:
        """Emit the open decode slice, if any."""
        if tr.run is not None:
            run, tr.run = tr.run, None
            self.slice(tr, "decode", run.pop("start"), run.pop("end"), run)

    def finish(self, tr: _Track, name: str, at: int, args: dict[str, Any]) -> None:
        """The request is done: close what is open, mark `name` ("finished" | "aborted")."""
        self.flush(tr)
        self.close_wait(tr, at)
        self.move(tr, "done")
        self.instant(REQUESTS_PID, tr.tid, name, "request", max(at, tr.cursor),
                     {"request_id": tr.rid, "generated_tokens": tr.generated, **args})

    def schedule(self, tr: _Track, s: StepSummary, start: int, end: int) -> None:
        """The request is in step `s`: a prefill slice, or one more step of a decode run."""
        rid = tr.rid
        self.close_wait(tr, start)
        self.move(tr, "running")
        tr.last_end = end
        gen = s.generated.get(rid, 0)
        tr.generated += gen
        n, prefill = s.scheduled[rid], s.prefill.get(rid, 0)
        if prefill:
            self.flush(tr)
            args = {"step": s.index, "prefill_tokens": prefill, "decode_tokens": n - prefill,
                    "num_computed_tokens": s.computed.get(rid, 0), "generated_tokens": gen}
            if rid in s.cached_prefix:
                args["cached_prefix_tokens"] = s.cached_prefix[rid]
            if rid in s.resumed:
                args["recompute"] = True  # after a preemption: prompt and outputs again
            self.slice(tr, "prefill", start, end, args)
            return
        run = tr.run
        if run is not None and run["last_step"] == s.index - 1:
            run.update(end=end, last_step=s.index, steps=run["steps"] + 1, tokens=run["tokens"] + n,
                       generated_tokens=run["generated_tokens"] + gen)
            return
        self.flush(tr)
        tr.run = {"start": start, "end": end, "first_step": s.index, "last_step": s.index, "steps": 1, "tokens": n,
                  "generated_tokens": gen}

    def build(self, arrivals: list[RequestAdded], aborts: list[RequestAborted], crashes: list[Crash],
              finish_reason: Callable[[str], str | None]) -> None:
        """Walk the steps in order: arrivals and aborts before the step they name, then what the step reports
        finished or preempted, then what it schedules; the step itself and the counters last. `finish_reason`
        tells the requests still running at the end that had in fact finished (their report was never stepped)."""
        indices = [s.index for s in self.steps]  # non-decreasing: the writer refuses a step that goes back
        due: dict[int, list[RequestAdded | RequestAborted]] = {}
        for rec in sorted(arrivals + aborts, key=lambda rec: rec.step):  # stable: arrivals before aborts
            due.setdefault(bisect.bisect_left(indices, rec.step), []).append(rec)
        # wall clock -> engine clock: the largest offset that keeps every arrival at or before its step's start
        anchors = [self.spans[pos][0] - round(a.request.arrival_time * 1e9) for pos, recs in due.items()
                   if pos < len(self.steps) and self.steps[pos].timing is not None
                   for a in recs if isinstance(a, RequestAdded)]
        offset = min(anchors, default=None)
        for pos in range(len(self.steps) + 1):
            at = self.spans[pos][0] if pos < len(self.steps) else self.end
            for rec in due.get(pos, ()):
                if isinstance(rec, RequestAborted):
                    tr = self.tracks.get(rec.request_id)
                    if tr is not None and tr.state != "done":
                        self.finish(tr, "aborted", at, {"before_step": rec.step})
                    continue
                tr = self.track(rec.request.request_id)
                if tr.state == "new":
                    wall = at if offset is None else round(rec.request.arrival_time * 1e9) + offset
                    if pos:  # and no earlier than the previous step's start: it arrived after that began
                        wall = max(wall, self.spans[pos - 1][0])
                    self.move(tr, "waiting", min(at, wall))
            if pos < len(self.steps):
                self.run_step(pos)
        for tr in self.tracks.values():  # still open when the capture ends
            reason = finish_reason(tr.rid) if tr.state == "running" and tr.last_end is not None else None
            if reason is not None:
                self.finish(tr, "finished", tr.last_end, {"finish_reason": reason, "inferred": True})
            self.flush(tr)
            self.close_wait(tr, self.end)
        where = {s.index: pos for pos, s in enumerate(self.steps)}
        for c in crashes:  # it raised in execute: right after the schedule (at the end when the step is lost)
            pos = where.get(c.step)
            ts, tid = (self.end, 1) if pos is None else (self.spans[pos][0], 1 + self.spans[pos][2])
            if pos is not None and self.steps[pos].timing is not None:
                ts += self.steps[pos].timing.schedule_ns
            self.instant(ENGINE_PID, tid, f"crash: {c.error_type}", "crash", ts,
                         {"step": c.step, "error_type": c.error_type, "message": c.message})

    def run_step(self, pos: int) -> None:
        """What step `pos` reports (finished after the previous step, preempted now) and what it schedules."""
        s = self.steps[pos]
        start, dur, _ = self.spans[pos]
        for rid in sorted(s.finished):  # aborted ones are marked already
            tr = self.tracks.get(rid)
            if tr is not None and tr.state != "done":
                self.finish(tr, "finished", start if tr.last_end is None else tr.last_end,
                            {"reported_at_step": s.index})
        for rid in sorted(s.preempted):
            tr = self.track(rid)
            if tr.state == "running":
                self.flush(tr)
                self.move(tr, "preempted", start)
        for rid in s.scheduled:
            self.schedule(self.track(rid), s, start, start + dur)
        self.step(pos)
        self.counters(pos)

    # -- engine --------------------------------------------------------------------------------------------------

    def meta(self, pid: int, tid: int, name: str, value: Any) -> None:
        """A metadata ("M") event: process / thread names and sort order."""
        key = "sort_index" if name.endswith("sort_index") else "name"
        self.events.append({"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}})

    def step(self, pos: int) -> None:
        """The step's slice and its schedule / execute / update children, with what it held as args."""
        s = self.steps[pos]
        start, dur, lane = self.spans[pos]
        prefill = sum(s.prefill.values())
        args: dict[str, Any] = {
            "step": s.index, "num_requests": len(s.scheduled), "scheduled_tokens": sum(s.scheduled.values()),
            "prefill_tokens": prefill, "decode_tokens": sum(s.scheduled.values()) - prefill,
            "new_requests": s.new, "resumed_requests": len(s.resumed), "preempted_req_ids": sorted(s.preempted),
            "finished_requests": len(s.finished), "generated_tokens": sum(s.generated.values()),
            "prefix_cache_hits": len(s.cached_prefix), "prefix_cached_tokens": sum(s.cached_prefix.values()),
        }
        if not s.ran:
            args["no_output"] = True
        if s.timing is None:
            args["nominal_timing"] = True
        tid = 1 + lane
        self.events.append({"name": f"step {s.index}", "cat": "step", "ph": "X", "pid": ENGINE_PID, "tid": tid,
                            "ts": start, "dur": dur, "args": args})
        if s.timing is not None:
            t, at = s.timing, start
            for name, d in (("schedule", t.schedule_ns), ("execute", t.execute_ns), ("update", t.update_ns)):
                self.events.append({"name": name, "cat": "step_phase", "ph": "X", "pid": ENGINE_PID, "tid": tid,
                                    "ts": at, "dur": d, "args": {"step": s.index}})
                at += d

    def counters(self, pos: int) -> None:
        """Running and waiting requests (after this step's scheduling) and its tokens, at the step's start."""
        s, ts, states = self.steps[pos], self.spans[pos][0], self.states
        prefill = sum(s.prefill.values())
        for name, args in (("running requests", {"running": states["running"]}),
                           ("waiting requests", {"waiting": states["waiting"] + states["preempted"]}),
                           ("scheduled tokens", {"prefill": prefill, "decode": sum(s.scheduled.values()) - prefill})):
            self.events.append({"name": name, "cat": "counter", "ph": "C", "pid": ENGINE_PID, "tid": 1, "ts": ts,
                                "args": args})


def perfetto_trace(path: str | os.PathLike) -> tuple[dict[str, Any], list[Damage]]:
    """The trace-event document of the capture at `path` (see the module docstring for its shape), built from
    every readable record, and the damage met reading it."""
    steps: list[StepSummary] = []
    arrivals: list[RequestAdded] = []
    aborts: list[RequestAborted] = []
    crashes: list[Crash] = []
    summarizer = StepSummarizer()
    status = "unfinished"
    with CaptureReader(path) as r:
        for rec in r.records():
            if isinstance(rec, Step):
                steps.append(summarizer.summarise(rec))
            elif isinstance(rec, RequestAdded):
                arrivals.append(rec)
                summarizer.add_request(rec.request)
            elif isinstance(rec, RequestAborted):
                aborts.append(rec)
            elif isinstance(rec, Crash):
                crashes.append(rec)
            elif isinstance(rec, Footer):
                status = rec.status
        header, damage = r.header, list(r.damage)
    infer_preemptions(steps)
    t = _Trace(steps, {a.request.request_id: a.request.name for a in arrivals if a.request.external_req_id})
    t.build(arrivals, aborts, crashes, summarizer.finish_reason)
    return _document(t, header, status, damage, str(path)), damage


def _document(t: _Trace, header: Header, status: str, damage: list[Damage], path: str) -> dict[str, Any]:
    """Name the processes and threads, put times in µs from the earliest event, and add what the trace is."""
    for pid, name in ((ENGINE_PID, "engine"), (REQUESTS_PID, "requests")):
        t.meta(pid, 0, "process_name", name)
        t.meta(pid, 0, "process_sort_index", pid)
    for lane in range(t.lanes):
        t.meta(ENGINE_PID, 1 + lane, "thread_name", "steps" if lane == 0 else f"steps (overlap {lane})")
    origin = min((e["ts"] for e in t.events if "ts" in e), default=0)
    for e in t.events:
        if "ts" in e:
            e["ts"] = (e["ts"] - origin) / 1000  # int / int rounds once: exact to the ns in the shortest repr
        if "dur" in e:
            e["dur"] = e["dur"] / 1000
    # metadata first, then by time; a parent before the children that start with it (longest first), but
    # zero-length events (instants too) before what starts with them: otherwise a viewer nests them inside it
    t.events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0), e.get("dur", 0) > 0, -e.get("dur", 0)))
    n, nominal = len(t.steps), f"back to back, {NOMINAL_STEP_NS // 1000} µs each, with no schedule / execute / update"
    timing = ("measured: each step's StepTiming, on the engine's monotonic clock" if not t.untimed else
              f"nominal: no step records timing; steps are laid out {nominal}" if t.untimed == n else
              f"partly nominal: {t.untimed} of {n} steps record no timing and are laid out {nominal}")
    meta = {
        "capture": path, "engine": header.engine, "engine_version": header.engine_version,
        "model": header.model.name if header.model is not None else "", "status": status, "steps": n,
        "requests": len(t.tracks), "timing": timing, "clock_origin_ns": origin,
        "async_overlap": (f"steps overlap: spread over {t.lanes} engine threads" if t.lanes > 1 else "none"),
        "damage": [f"{d.kind}: {d.describe()}" for d in damage],
    }
    return {"traceEvents": t.events, "displayTimeUnit": "ms", "metadata": meta}


def export_perfetto(path: str | os.PathLike, out: IO[str]) -> tuple[int, list[Damage]]:
    """Write the capture at `path` to `out` as a trace-event JSON document (`perfetto_trace`). Returns (trace
    events written, damage met)."""
    doc, damage = perfetto_trace(path)
    out.write(msgspec.json.encode(doc).decode())
    out.write("\n")
    return len(doc["traceEvents"]), damage
