"""A prompt encoded at its arrival is reused by the step that first schedules the request only where that is exact:
the step's list holds the very objects the arrival's did. A list mutated, rebuilt, holding another object or past the budget
is encoded as ever, and every capture reads back bit for bit."""

from __future__ import annotations

import sys

import msgspec
import pytest
from msgspec.structs import replace

from replay.capture import CaptureReader, CaptureWriter, RequestAdded, Step
from replay.capture.format import records as fmt
from replay.capture.codec.fastwire import COMPILED
from replay.capture.format.ids import IdTable
from replay.capture.codec.prompts import ArrivedPrompts
from replay.capture.codec.stepcodec import step_to_wire, stored_step
from replay.contracts import (
    CachedRequestData,
    EngineCoreRequest,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from replay.provenance import make_header

ENC = fmt.WIRE_ENCODER.encode
needs_compiled = pytest.mark.skipif(COMPILED is None, reason="replay.capture._wire was not built (no C compiler)")


def _request(rid: str, prompt: list) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, None, SamplingParams(), None, 0.0, None, None, None)


def _first_schedule(request: EngineCoreRequest, prompt: list | None = None) -> SchedulerOutput:
    """A step that schedules `request` for the first time, its prompt `prompt` (the request's own list by default)."""
    prompt = request.prompt_token_ids if prompt is None else prompt
    new = NewRequestData(request.request_id, prompt, [], request.sampling_params, None, ([0],), 0, None)
    return replace(SchedulerOutput.make_empty(), scheduled_new_reqs=[new],
                   num_scheduled_tokens={request.request_id: len(prompt)}, total_num_scheduled_tokens=len(prompt),
                   scheduled_cached_reqs=CachedRequestData.make_empty())


@needs_compiled
def test_the_step_stores_the_arrivals_bytes_and_they_read_back():
    prompts, table = ArrivedPrompts(), IdTable()
    req = _request("a", list(range(1000, 4000)))
    held = prompts.arrived(req)
    assert isinstance(held.prompt_token_ids, msgspec.Raw) and prompts.held_tokens == 3000
    assert ENC(fmt.RequestAdded(0, held)) == ENC(fmt.RequestAdded(0, req))
    step = Step(0, _first_schedule(req), None)
    wire, _ = stored_step(step, table, None, prompts)
    assert isinstance(wire.scheduler_output.scheduled_new_reqs[0].prompt_token_ids, msgspec.Raw)
    assert prompts.held_tokens == 0  # used once: the request is not new again
    assert ENC(wire) == ENC(step_to_wire(step, IdTable()))


@needs_compiled
@pytest.mark.parametrize("change", ["mutated", "rebuilt", "an equal int", "shorter"])
def test_a_prompt_changed_after_its_arrival_is_stored_as_the_step_holds_it(tmp_path, change):
    """The arrival's bytes are for the arrival's objects: any other list (even one == to it) is encoded itself."""
    prompt = list(range(5000, 5600))
    req = _request("r", prompt)
    path = tmp_path / f"{change}.capture"
    with CaptureWriter(path, make_header("test")) as w:
        w.add_request(req, 0)
        arrived = list(prompt)
        if change == "mutated":
            prompt[7] = 99_999  # in place: same list object, other values
        elif change == "an equal int":
            prompt[3] = int(str(prompt[3]))  # the same value, another object
        elif change == "shorter":
            del prompt[-1]
        stepped = list(prompt) if change == "rebuilt" else prompt
        w.write_step(0, _first_schedule(req, stepped), None)
    with CaptureReader(path) as r:
        recs = list(r.records())
    added = next(x for x in recs if isinstance(x, RequestAdded))
    step = next(x for x in recs if isinstance(x, Step))
    assert added.request.prompt_token_ids == arrived
    got = step.scheduler_output.scheduled_new_reqs[0].prompt_token_ids
    assert got == prompt and list(map(type, got)) == list(map(type, prompt))


@needs_compiled
def test_what_is_held_is_bounded_kept_alive_and_forgotten_on_abort():
    prompts = ArrivedPrompts(max_tokens=1000)
    a, b = _request("a", [10**6 + i for i in range(800)]), _request("b", list(range(300)))
    item = a.prompt_token_ids[5]
    refs = sys.getrefcount(item)
    assert prompts.arrived(a) is not a and prompts.arrived(b) is b  # b would pass the budget: encoded as ever
    assert prompts.held_tokens == 800
    # the encoded objects are held: one freed by a change to the list cannot have its address reused by another int
    assert sys.getrefcount(item) == refs + 1
    prompts.forget("a")
    assert sys.getrefcount(item) == refs and prompts.held_tokens == 0
    assert prompts.arrived(b) is not b and prompts.held_tokens == 300
    assert prompts.arrived(_request("b", list(range(200)))) is not None and prompts.held_tokens == 200  # id reused
    prompts.clear()
    assert prompts.held_tokens == 0


@needs_compiled
def test_a_prompt_the_compiled_pass_does_not_take_is_not_held():
    prompts = ArrivedPrompts()
    for prompt in ([1, True, 3], [1, 2.0], [2**64], [], None):
        req = _request("x", prompt)
        assert prompts.arrived(req) is req
    assert prompts.held_tokens == 0


def test_without_the_compiled_passes_nothing_is_held(monkeypatch):
    monkeypatch.setattr("replay.capture.codec.prompts.COMPILED", None)
    prompts = ArrivedPrompts()
    req = _request("x", list(range(100)))
    assert prompts.arrived(req) is req and prompts.held_tokens == 0


@needs_compiled
def test_same_items_compares_the_objects_not_their_values():
    xs = [10**9 + i for i in range(50)]
    assert COMPILED.same_items(xs, tuple(xs)) and COMPILED.same_items([], ())
    assert not COMPILED.same_items(xs, [x + 0 * 1 for x in map(int, map(str, xs))])  # equal values, other objects
    assert not COMPILED.same_items(xs, xs[:-1])
    data, held = COMPILED.ints_held(xs)
    assert data == ENC(xs) and held == tuple(xs) and all(a is b for a, b in zip(held, xs))
    with pytest.raises(TypeError):
        COMPILED.same_items(xs, iter(xs))


@needs_compiled
def test_the_writer_holds_an_arrival_until_it_is_scheduled_or_aborted(tmp_path):
    a, b = _request("a", list(range(100, 400))), _request("b", list(range(100, 200)))
    path = tmp_path / "held.capture"
    with CaptureWriter(path, make_header("test")) as w:
        w.add_request(a, 0)
        w.add_request(b, 0)
        assert w._prompts.held_tokens == 400
        w.abort_request("b", 0)
        assert w._prompts.held_tokens == 300
        w.write_step(0, _first_schedule(a), None)
        assert w._prompts.held_tokens == 0
    with CaptureReader(path) as r:
        step = r.step(0)
        assert r.damage == []
    assert step.scheduler_output.scheduled_new_reqs[0].prompt_token_ids == a.prompt_token_ids


@needs_compiled
def test_a_writer_of_image_steps_holds_no_prompt(tmp_path):
    """Steps that come as images (another engine's) never reuse an arrival's bytes: nothing is held for them, from
    the first image step on, or from the start where the writer is told (the vLLM writer process)."""
    enc = msgspec.msgpack.Encoder()
    with CaptureWriter(tmp_path / "images.capture", make_header("test")) as w:
        w.add_request(_request("a", list(range(100, 400))), 0)
        assert w._prompts.held_tokens == 300
        w.write_step_image(0, enc.encode({"total_num_scheduled_tokens": 0}), None)
        assert w._prompts.held_tokens == 0
        w.add_request(_request("b", list(range(100, 400))), 1)
        assert w._prompts.held_tokens == 0
    with CaptureWriter(tmp_path / "told.capture", make_header("test")) as w:
        w.steps_as_images()
        w.add_request(_request("a", list(range(100, 400))), 0)
        assert w._prompts.held_tokens == 0
