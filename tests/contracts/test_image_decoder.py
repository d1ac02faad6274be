"""ImageDecoder: another engine's msgpack image -> contracts, typed where it can, always what the tolerant walk
gives."""

from __future__ import annotations

import msgspec

from replay.contracts import ModelRunnerOutput, SchedulerOutput
from replay.contracts.image_decoder import ImageDecoder
from replay.contracts.tolerant import TolerantConverter
from replay.record.synth import SynthShape, synth_events
from tests.images import as_map

WL = SynthShape(steps=12, running=5, prompt_len=(4, 30), output_len=(2, 9), num_logprobs=4, vocab_size=900, seed=3)


def _images():
    enc = msgspec.msgpack.Encoder()
    for ev in synth_events(WL):
        if ev.request is None:
            yield enc.encode(as_map(ev.scheduler_output)), SchedulerOutput[str]
            yield enc.encode(as_map(ev.model_runner_output)), ModelRunnerOutput[str]


def test_steps_decode_on_the_typed_path_to_what_the_tolerant_walk_gives():
    dec, tolerant = ImageDecoder(), TolerantConverter()
    n = 0
    for image, contract in _images():
        assert dec.decode(image, contract) == tolerant.convert(msgspec.msgpack.decode(image), contract)
        n += 1
    assert n == 2 * WL.steps and dec.fallbacks == 0


def test_private_sampling_fields_are_read_as_the_tolerant_walk_reads_them():
    """vLLM keeps `_all_stop_token_ids` private; a new request's image carries it under that spelling."""
    ev = next(e for e in synth_events(WL) if e.scheduler_output is not None and e.scheduler_output.scheduled_new_reqs)
    image = as_map(ev.scheduler_output)
    sp = image["scheduled_new_reqs"][0]["sampling_params"]
    sp["_all_stop_token_ids"] = [2, 7]
    sp.pop("all_stop_token_ids", None)
    sp["a_field_we_do_not_mirror"] = 1
    data = msgspec.msgpack.encode(image)
    dec = ImageDecoder()
    got = dec.decode(data, SchedulerOutput[str])
    assert got.scheduled_new_reqs[0].sampling_params.all_stop_token_ids == [2, 7]
    assert got == TolerantConverter().convert(msgspec.msgpack.decode(data), SchedulerOutput[str])
    assert dec.fallbacks == 0


def test_an_image_of_another_kind_falls_back_to_the_tolerant_walk():
    """Version drift the typed path refuses: vLLM's `stop` may be one string where we keep a list."""
    ev = next(e for e in synth_events(WL) if e.scheduler_output is not None and e.scheduler_output.scheduled_new_reqs)
    image = as_map(ev.scheduler_output)
    image["scheduled_new_reqs"][0]["sampling_params"]["stop"] = "END"
    dec = ImageDecoder()
    data = msgspec.msgpack.encode(image)
    got = dec.decode(data, SchedulerOutput[str])
    assert got == TolerantConverter().convert(msgspec.msgpack.decode(data), SchedulerOutput[str])
    assert got.scheduled_new_reqs[0].sampling_params.stop == ["END"] and dec.fallbacks == 1
