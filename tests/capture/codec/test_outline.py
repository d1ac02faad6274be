"""What the keyframe shadow reads of an image step: the view holds the contract's values for the fields it reads, an
image of other kinds takes the whole decode, and keyframes made from images equal those made from contracts."""

from __future__ import annotations

import msgspec
import pytest

from replay.capture import CaptureReader, CaptureWriter, Keyframe
from replay.capture.codec.columns import ColumnSink, ColumnSource
from replay.capture.codec.outline import ImageOutline, SchedulerView, scheduled, step_outline
from replay.capture.codec.step_image import store_step_image
from replay.capture.format import records as fmt
from replay.contracts import SchedulerOutput
from replay.contracts.image_decoder import ImageDecoder
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events
from tests.images import as_map, as_parts

ENC = msgspec.msgpack.Encoder()
# chunked prefill (a small token budget), seeded and greedy requests, requests finishing and arriving throughout
SHAPE = SynthShape(steps=90, running=12, num_logprobs=2, prompt_len=(8, 60), output_len=(3, 25), vocab_size=1000,
                   block_size=16, max_num_batched_tokens=48, seed=7)


def _fields(x, names) -> dict:
    return {n: getattr(x, n) for n in names}


def test_the_view_holds_what_the_contract_holds_in_every_field_it_reads():
    decoder, seen = ImageDecoder(), 0
    for ev in synth_events(SHAPE):
        if ev.request is not None:
            continue
        so = ev.scheduler_output
        view = scheduled(ENC.encode(as_map(so)), decoder)
        assert isinstance(view, SchedulerView)
        assert _fields(view, ("num_scheduled_tokens", "scheduled_spec_decode_tokens", "finished_req_ids",
                              "preempted_req_ids")) == _fields(so, ("num_scheduled_tokens",
                                                                    "scheduled_spec_decode_tokens",
                                                                    "finished_req_ids", "preempted_req_ids"))
        cached = ("req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens", "num_output_tokens")
        assert _fields(view.scheduled_cached_reqs, cached) == _fields(so.scheduled_cached_reqs, cached)
        new = ("req_id", "prompt_token_ids", "block_ids", "num_computed_tokens")
        assert [_fields(n, new) for n in view.scheduled_new_reqs] == [_fields(n, new) for n in so.scheduled_new_reqs]
        seen += len(so.scheduled_new_reqs) + len(so.scheduled_cached_reqs.req_ids)
    assert seen > 300


def test_an_image_of_other_kinds_takes_the_whole_decode():
    ev = next(e for e in synth_events(SHAPE) if e.request is None)
    image = as_map(ev.scheduler_output)
    del image["scheduled_cached_reqs"]["num_output_tokens"]  # an older engine's image: the view cannot hold it
    assert isinstance(scheduled(ENC.encode(image), ImageDecoder()), SchedulerOutput)
    image = as_map(ev.scheduler_output)
    image["num_scheduled_tokens"] = {k: str(v) for k, v in image["num_scheduled_tokens"].items()}  # another kind
    assert not isinstance(scheduled(ENC.encode(image), ImageDecoder()), SchedulerView)


def _keyframes(path, *, images: bool | str, arrivals: bool = True) -> list[Keyframe]:
    with CaptureWriter(path, make_header("test"), keyframes=10) as w:
        for ev in synth_events(SHAPE):
            if ev.request is not None:
                if arrivals:
                    w.add_request(ev.request, ev.step)
            elif images:
                mro = (as_parts(ev.model_runner_output) if images == "parts"
                       else ENC.encode(as_map(ev.model_runner_output)))
                w.write_step_image(ev.step, ENC.encode(as_map(ev.scheduler_output)), mro, None, None)
            else:
                w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
    with CaptureReader(path) as r:
        return [x for x in r.records() if isinstance(x, Keyframe)]


@pytest.mark.parametrize("images", [True, "parts"])
@pytest.mark.parametrize("arrivals", [True, False], ids=["arrivals", "attached-mid-run"])
def test_keyframes_folded_from_images_are_those_folded_from_contracts(tmp_path, images, arrivals):
    expected = _keyframes(tmp_path / "c.capture", images=False, arrivals=arrivals)
    got = _keyframes(tmp_path / "i.capture", images=images, arrivals=arrivals)
    assert len(expected) >= 8 and got == expected
    # without arrival records, the requests a keyframe holds come from their NewRequestData, sampling params and all
    assert any(r.request.sampling_params is not None and r.request.sampling_params.seed is not None
               for k in got for r in k.requests)


def test_a_stored_image_step_folds_as_the_images_it_was_sent_as(tmp_path):
    decoder = ImageDecoder()
    for ev in list(synth_events(SHAPE))[:60]:
        if ev.request is not None:
            continue
        so, out = ENC.encode(as_map(ev.scheduler_output)), as_parts(ev.model_runner_output)
        sink = ColumnSink()
        rec, _ = store_step_image(ev.step, so, out, None, None, sink, decoder)
        columns = sink.seal()
        stored = step_outline(fmt.WIRE_DECODER.decode(fmt.WIRE_ENCODER.encode(rec)), decoder,
                              ColumnSource(columns) if columns is not None else None)
        sent = ImageOutline(ev.step, so, out).outline(decoder)
        assert stored == sent
        assert stored.model_runner_output.sampled_token_ids == ev.model_runner_output.sampled_token_ids
