"""export --format perfetto: a real builtin recording (a small KV pool, so requests are preempted; a shared prefix;
two aborts) becomes a well-formed trace-event timeline, one slice per step, one track per request, counters per
step; a crash, a capture without timing, overlapping (async) step timings and a damaged capture come out right too."""

from __future__ import annotations

import io
import json
import time
from collections import Counter, defaultdict

import msgspec
import pytest

from replay.capture import CaptureReader, CaptureWriter, RequestAdded, Step, StepTiming
from replay.cli import main
from replay.contracts import EngineCoreRequest, SamplingParams
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.engine.engine import LLMEngine
from replay.inspect import capture_info, export_records, perfetto_trace
from replay.record import CaptureTap

SMALL_POOL = SchedulerConfig(block_size=4, num_gpu_blocks=24, max_num_seqs=8, max_num_batched_tokens=16)
# r0's prompt is 20 tokens; r1's starts with its first 16 (4 blocks), which r0's first step computes: a prefix hit
PROMPTS = [list(range(5, 25)), list(range(5, 21)) + [300, 301, 302, 303]] + [list(range(5 + i, 25 + 2 * i))
                                                                             for i in range(2, 6)]


def _record(path, *, crash: bool = False):
    """Six requests at step 0 in a KV pool too small for them (preemptions); before step 3, r1 (running) and r5
    (still waiting) are aborted and "late" arrives. With `crash`, a request holding a token id outside the
    vocabulary (the engine does not check requests built elsewhere) makes the model raise at its first step."""
    engine = LLMEngine(EngineConfig(scheduler=SMALL_POOL, runner=RunnerConfig(num_threads=1)))
    writer = CaptureWriter(path, engine.header(), chunk_bytes=2000)  # many chunks: a cut loses only some
    tap = CaptureTap(writer)
    engine.listeners.append(tap)
    try:
        ids = [engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12), f"r{i}")
               for i, prompt in enumerate(PROMPTS)]
        for _ in range(3):
            engine.step()
        engine.abort_request(ids[1])
        engine.abort_request(ids[5])
        engine.add_request(list(range(3, 30)), SamplingParams(temperature=0.0, max_tokens=5), "late")
        if crash:
            engine.add_engine_core_request(EngineCoreRequest("bad-0", [7, 99_999], None, SamplingParams(), None,
                                                             time.time(), None, None, None, external_req_id="bad"))
        while engine.has_unfinished_requests():
            engine.step()
    except IndexError:  # the planted bad token id, in the model's embedding
        if not crash:
            raise
    writer.close(status=tap.crash_status or "ok")
    return path


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    """The recording, and its trace exported through the library into a file."""
    path = _record(tmp_path_factory.mktemp("perfetto") / "run.capture")
    out = path.with_suffix(".json")
    with open(out, "w") as f:
        n, damage = export_records(path, f, "perfetto")
    assert damage == []
    trace = json.loads(out.read_text())
    assert n == len(trace["traceEvents"])
    return path, trace


def _ns(us: float) -> int:
    return round(us * 1000)


def _truth(path):
    """Steps and external ids of the capture, and the tokens each request sampled."""
    steps, ext, sampled = [], {}, Counter()
    with CaptureReader(path) as r:
        for rec in r.records():
            if isinstance(rec, RequestAdded):
                ext[rec.request.request_id] = rec.request.external_req_id
            elif isinstance(rec, Step):
                steps.append(rec)
                mro = rec.model_runner_output
                for rid, toks in zip(mro.req_ids, mro.sampled_token_ids) if mro is not None else ():
                    sampled[rid] += len(toks)
    return steps, ext, sampled


def _request_tracks(trace) -> dict[str, list[dict]]:
    """Thread name -> its events in time order."""
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 2}
    out = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["pid"] == 2 and e["ph"] != "M":
            out[names[e["tid"]]].append(e)
    for events in out.values():
        events.sort(key=lambda e: (_ns(e["ts"]), e["ph"] == "i"))
    return out


def _assert_well_formed(trace):
    """On every thread, complete slices nest or follow each other: never a partial overlap."""
    spans = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            spans[e["pid"], e["tid"]].append((_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])))
        else:
            assert e["ph"] in ("M", "C", "i"), e
    for thread, slices in spans.items():
        stack: list[int] = []
        for start, end in sorted(slices, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], (thread, start, end)
            stack.append(end)


def test_the_trace_is_a_json_object_with_well_formed_events(builtin):
    path, trace = builtin
    assert trace["displayTimeUnit"] == "ms"
    meta = trace["metadata"]
    assert meta["engine"] == "builtin" and meta["status"] == "ok" and meta["damage"] == []
    assert meta["timing"].startswith("measured") and meta["async_overlap"] == "none"
    _assert_well_formed(trace)
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert processes == {1: "engine", 2: "requests"}


def test_every_step_has_one_engine_slice_with_schedule_execute_update_inside(builtin):
    path, trace = builtin
    steps, _, _ = _truth(path)
    slices = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    assert Counter(e["args"]["step"] for e in slices) == Counter(s.index for s in steps)
    phases = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("cat") == "step_phase":
            phases[e["args"]["step"]].append(e)
    for e, s in zip(sorted(slices, key=lambda e: e["args"]["step"]), steps):
        assert e["name"] == f"step {s.index}" and e["tid"] == 1
        so = s.scheduler_output
        assert e["args"]["scheduled_tokens"] == so.total_num_scheduled_tokens
        assert e["args"]["prefill_tokens"] + e["args"]["decode_tokens"] == so.total_num_scheduled_tokens
        assert e["args"]["num_requests"] == len(so.num_scheduled_tokens)
        start, end = _ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])
        children = sorted(phases[s.index], key=lambda c: _ns(c["ts"]))
        assert [c["name"] for c in children] == ["schedule", "execute", "update"]
        for c in children:
            assert start <= _ns(c["ts"]) and _ns(c["ts"]) + _ns(c["dur"]) <= end
        assert _ns(children[0]["ts"]) == start
        assert _ns(children[1]["ts"]) >= _ns(children[0]["ts"]) + _ns(children[0]["dur"])


def test_every_request_has_a_track_with_ordered_phases_and_its_tokens(builtin):
    path, trace = builtin
    steps, ext, sampled = _truth(path)
    tracks = _request_tracks(trace)
    assert set(tracks) == set(ext.values())
    total = 0
    for rid, name in ext.items():
        events = tracks[name]
        names = [e["name"] for e in events]
        assert names[0] == "waiting" and names[-1] in ("finished", "aborted"), (name, names)
        assert names.count("finished") + names.count("aborted") == 1
        if "decode" in names:
            assert "prefill" in names[:names.index("decode")], (name, names)
        end = 0
        for e in events:  # one after the other
            assert _ns(e["ts"]) >= end, (name, names)
            end = _ns(e["ts"]) + _ns(e.get("dur", 0))
        generated = sum(e["args"].get("generated_tokens", 0) for e in events if e["ph"] == "X")
        assert generated == sampled[rid] == events[-1]["args"]["generated_tokens"], name
        total += generated
    assert total == capture_info(path).num_generated_tokens
    assert [e["name"] for e in tracks["r0"]][:3] == ["waiting", "prefill", "prefill"]  # 20 prompt tokens, budget 16
    decode = next(e for e in tracks["r0"] if e["name"] == "decode")
    assert decode["args"]["steps"] == decode["args"]["last_step"] - decode["args"]["first_step"] + 1 > 1


def test_counters_at_every_step(builtin):
    path, trace = builtin
    starts = sorted(_ns(e["ts"]) for e in trace["traceEvents"] if e.get("cat") == "step")
    counters = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "C":
            counters[e["name"]].append(e)
    assert set(counters) == {"running requests", "waiting requests", "scheduled tokens"}
    for events in counters.values():
        assert sorted(_ns(e["ts"]) for e in events) == starts
    steps, _, _ = _truth(path)
    tokens = sorted(counters["scheduled tokens"], key=lambda e: e["ts"])
    assert [e["args"]["prefill"] + e["args"]["decode"] for e in tokens] == \
        [s.scheduler_output.total_num_scheduled_tokens for s in steps]
    assert counters["waiting requests"][0]["args"]["waiting"] == 5  # six arrived, one scheduled


def test_preempted_requests_show_a_preempted_slice_until_they_resume(builtin):
    path, trace = builtin
    steps, ext, _ = _truth(path)
    preempted = {rid for s in steps for rid in s.scheduler_output.preempted_req_ids or ()}
    assert preempted  # the small pool did its job
    tracks = _request_tracks(trace)
    for rid in preempted:
        names = [e["name"] for e in tracks[ext[rid]]]
        i = names.index("preempted")
        assert names[i - 1] in ("prefill", "decode") and names[i + 1] in ("prefill", "decode")
    engine = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    assert {rid for e in engine for rid in e["args"]["preempted_req_ids"]} == preempted


def test_aborted_requests_get_an_aborted_instant(builtin):
    _, trace = builtin
    tracks = _request_tracks(trace)
    assert [e["name"] for e in tracks["r5"]] == ["waiting", "aborted"]  # never scheduled
    names = [e["name"] for e in tracks["r1"]]
    assert names[-1] == "aborted" and "prefill" in names and "finished" not in names
    assert tracks["r1"][-1]["ph"] == "i" and tracks["r1"][-1]["args"]["before_step"] == 3


def test_a_prefix_cache_hit_is_on_the_request_and_the_step(builtin):
    _, trace = builtin
    first = next(e for e in _request_tracks(trace)["r1"] if e["name"] == "prefill")
    assert first["args"]["cached_prefix_tokens"] == first["args"]["num_computed_tokens"] == 16
    step = next(e for e in trace["traceEvents"] if e.get("cat") == "step"
                and e["args"]["step"] == first["args"]["step"])
    assert step["args"]["prefix_cache_hits"] == 1 and step["args"]["prefix_cached_tokens"] > 0


def test_a_crash_is_an_instant_on_the_engine_track(tmp_path):
    path = _record(tmp_path / "crash.capture", crash=True)
    trace, damage = perfetto_trace(path)
    assert damage == [] and trace["metadata"]["status"].startswith("crashed at step")
    crash = [e for e in trace["traceEvents"] if e.get("cat") == "crash"]
    assert len(crash) == 1 and crash[0]["ph"] == "i" and crash[0]["pid"] == 1
    assert crash[0]["name"] == "crash: IndexError" and crash[0]["args"]["error_type"] == "IndexError"
    assert crash[0]["args"]["message"]
    last = max((e for e in trace["traceEvents"] if e.get("cat") == "step"), key=lambda e: e["args"]["step"])
    assert last["args"]["step"] == crash[0]["args"]["step"] and last["args"]["no_output"]
    assert last["ts"] <= crash[0]["ts"] <= last["ts"] + last["dur"]
    _assert_well_formed(trace)


def test_a_capture_without_timing_lays_steps_out_back_to_back(small_capture):
    trace, _ = perfetto_trace(small_capture)
    assert trace["metadata"]["timing"].startswith("nominal")
    steps = sorted((e for e in trace["traceEvents"] if e.get("cat") == "step"), key=lambda e: e["args"]["step"])
    assert len(steps) == 40 and not any(e.get("cat") == "step_phase" for e in trace["traceEvents"])
    assert all(_ns(a["ts"]) + _ns(a["dur"]) == _ns(b["ts"]) for a, b in zip(steps, steps[1:]))
    _assert_well_formed(trace)
    generated = sum(e["args"].get("generated_tokens", 0) for e in trace["traceEvents"]
                    if e["pid"] == 2 and e["ph"] == "X")
    assert generated == capture_info(small_capture).num_generated_tokens


def _rewrite(src, dst, change):
    """Copy the capture `src` to `dst`, each record through `change(record, steps)` (None drops it)."""
    with CaptureReader(src) as r:
        recs, header = list(r.records()), r.header
    steps = [x for x in recs if isinstance(x, Step)]
    with CaptureWriter(dst, header) as w:
        for rec in recs:
            rec = change(rec, steps)
            if rec is not None:
                w.write_record(rec)
    return steps


def test_overlapping_async_step_timings_stay_well_formed(builtin, tmp_path):
    """vLLM's async scheduling schedules step N+1 while step N executes (its `execute` runs from schedule()'s
    return to update_from_output): step timings overlap."""
    path, _ = builtin

    def overlap(rec, steps):  # a step every 10 ms, each 16 ms long: it overlaps the next one, never the one after
        if isinstance(rec, Step):
            t0 = steps[0].timing.start_ns
            return msgspec.structs.replace(rec, timing=StepTiming(t0 + rec.index * 10_000_000, 1_000_000,
                                                                  14_000_000, 1_000_000))
        return rec

    steps = _rewrite(path, tmp_path / "async.capture", overlap)
    trace, _ = perfetto_trace(tmp_path / "async.capture")
    _assert_well_formed(trace)
    engine = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    assert len(engine) == len(steps) and {e["tid"] for e in engine} == {1, 2}
    assert trace["metadata"]["async_overlap"] != "none"
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name" and e["pid"] == 1}
    assert lanes == {"steps", "steps (overlap 1)"}


def test_cli_exports_perfetto_and_a_damaged_capture_exits_3(builtin, tmp_path, capsys):
    path, trace = builtin
    out = tmp_path / "trace.json"
    assert main(["export", str(path), "--format", "perfetto", "-o", str(out)]) == 0
    assert json.loads(out.read_text()) == trace
    assert "trace events" in capsys.readouterr().err
    data = path.read_bytes()
    cut = tmp_path / "cut.capture"
    cut.write_bytes(data[: len(data) * 2 // 3])
    assert main(["export", str(cut), "--format", "perfetto", "-o", str(out)]) == 3
    partial = json.loads(out.read_text())
    assert partial["metadata"]["damage"] and partial["metadata"]["status"] == "unfinished"
    assert 0 < sum(e.get("cat") == "step" for e in partial["traceEvents"]) < sum(e.get("cat") == "step"
                                                                                 for e in trace["traceEvents"])
    _assert_well_formed(partial)
    capsys.readouterr()
    assert main(["export", str(path), "--format", "xml", "-o", str(out)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_library_export_to_a_stream(builtin):
    path, trace = builtin
    buf = io.StringIO()
    n, damage = export_records(path, buf, "perfetto")
    assert damage == [] and json.loads(buf.getvalue()) == trace and n == len(trace["traceEvents"])


def test_a_finish_the_capture_ends_before_reporting_is_inferred(builtin, tmp_path):
    """vLLM steps no more once nothing is unfinished, so the last requests' finish is never reported: a request
    that reached max_tokens is finished all the same (and says it was inferred)."""
    path, trace = builtin
    steps = _rewrite(path, tmp_path / "short.capture", lambda rec, steps: None if rec is steps[-1] else rec)
    (reported,) = steps[-1].scheduler_output.finished_req_ids
    short, _ = perfetto_trace(tmp_path / "short.capture")
    _, ext, _ = _truth(path)
    last = _request_tracks(short)[ext[reported]][-1]
    assert last["name"] == "finished" and last["args"]["finish_reason"] == "length" and last["args"]["inferred"]
    assert last["ts"] == _request_tracks(trace)[ext[reported]][-1]["ts"]
