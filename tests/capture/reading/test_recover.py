"""recover: every flushed record survives a crash; damage is named; nothing recoverable is exit 1."""

from __future__ import annotations

import pytest

from replay.capture import CaptureReader, CaptureWriter, Step
from replay.capture.reading.recover import default_output, recover
from replay.errors import NothingRecoverableError, UsageError
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events


def _write_abandoned(path, steps: int) -> list[int]:
    """Write `steps` steps, flush after each, then stop without closing (a crash). Returns steps flushed."""
    w = CaptureWriter(path, make_header("test"))
    flushed = []
    for ev in synth_events(SynthShape(steps=steps, running=4, prompt_len=(4, 8), output_len=(2, 6), seed=3)):
        if ev.request is not None:
            w.add_request(ev.request, ev.step)
        else:
            w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
            w.flush()
            flushed.append(ev.step)
    w.abandon()
    return flushed


def test_unfinished_capture_recovers_every_flushed_step(tmp_path):
    path = tmp_path / "crash.capture"
    flushed = _write_abandoned(path, 12)
    partial = tmp_path / "crash.capture.partial"
    assert default_output(partial) == path
    res = recover(partial)
    assert res.output == str(path) and res.num_steps == len(flushed)
    assert [d.kind for d in res.damage] == ["unfinished"] and res.lost_data
    with CaptureReader(path) as r:
        assert r.complete
        assert [x.index for x in r.records() if isinstance(x, Step)] == flushed
        assert "recovered from crash.capture.partial" in r.footer.status


def test_recovered_steps_equal_the_originals(small_capture, tmp_path):
    out = tmp_path / "copy.capture"
    res = recover(small_capture, out)
    assert not res.lost_data
    with CaptureReader(small_capture) as a, CaptureReader(out) as b:
        sa = [x for x in a.records() if isinstance(x, Step)]
        sb = [x for x in b.records() if isinstance(x, Step)]
    assert sa == sb


def test_damaged_chunk_is_named_and_the_rest_is_kept(small_capture, tmp_path):
    with CaptureReader(small_capture) as r:
        c = r.index.chunks[2]
    data = bytearray(small_capture.read_bytes())
    data[c.offset + c.length // 2] ^= 0x40
    small_capture.write_bytes(bytes(data))
    res = recover(small_capture, tmp_path / "fixed.capture")
    assert [d.chunk for d in res.damage] == [2] and res.lost_data
    assert res.num_steps == 40 - c.num_steps


def test_refuses_to_overwrite(small_capture, tmp_path):
    out = tmp_path / "o.capture"
    recover(small_capture, out)
    with pytest.raises(UsageError, match="already exists"):
        recover(small_capture, out)
    recover(small_capture, out, force=True)
    with pytest.raises(UsageError, match="other than the input"):
        recover(small_capture, small_capture)


def test_nothing_recoverable_when_the_header_is_gone(small_capture, tmp_path):
    cut = tmp_path / "cut.capture"
    cut.write_bytes(small_capture.read_bytes()[:30])
    with pytest.raises(NothingRecoverableError) as e:
        recover(cut)
    assert e.value.exit_code == 1


def test_image_steps_are_recovered_as_images_with_every_field_the_engine_sent(tmp_path):
    """A vLLM capture's steps are stored as vLLM's images, fields our contracts do not mirror included: recovering
    an unfinished one keeps them images, those fields and the logprob matrices in the new chunks' columns."""
    import msgspec

    from replay.capture.codec.step_image import OutputParts
    from replay.capture.format import records as fmt
    from tests.images import as_map, as_parts

    enc = msgspec.msgpack.Encoder()
    path = tmp_path / "img.capture"
    w = CaptureWriter(path, make_header("test"), chunk_bytes=3000)
    for ev in synth_events(SynthShape(steps=12, running=4, prompt_len=(4, 30), output_len=(3, 9), num_logprobs=3,
                                      seed=5)):
        if ev.request is not None:
            w.add_request(ev.request, ev.step)
            continue
        so = {**as_map(ev.scheduler_output), "a_field_we_do_not_mirror": [1, 2]}
        mro = as_parts(ev.model_runner_output)
        assert isinstance(mro, OutputParts)
        mro = mro._replace(rest=enc.encode({**msgspec.msgpack.decode(mro.rest), "another_one": "x"}))
        w.write_step_image(ev.step, enc.encode(so), mro, None, fmt.StepTiming(1, 2, 3, 4))
        w.flush()
    w.abandon()
    res = recover(path.with_name(path.name + ".partial"))
    assert res.num_steps == 12 and [d.kind for d in res.damage] == ["unfinished"]  # every step was flushed
    with CaptureReader(res.output) as r:
        stored = [fmt.WIRE_DECODER.decode(x) for ref in r.iter_chunks()
                  for x in fmt.CHUNK_DECODER.decode(r.read_chunk_bytes(ref))]
        steps = list(r.steps())
    images = [x for x in stored if isinstance(x, fmt.StepImage)]
    assert len(images) == 12 and sum(isinstance(x, fmt.LogprobColumns) for x in stored) >= 1
    assert all(msgspec.msgpack.decode(x.scheduler_output)["a_field_we_do_not_mirror"] == [1, 2] for x in images)
    assert all(msgspec.msgpack.decode(x.model_runner_output)["another_one"] == "x" for x in images)
    original = [ev for ev in synth_events(SynthShape(steps=12, running=4, prompt_len=(4, 30), output_len=(3, 9),
                                                     num_logprobs=3, seed=5)) if ev.request is None]
    assert [s.model_runner_output.logprobs for s in steps] == [ev.model_runner_output.logprobs for ev in original]
    assert [s.model_runner_output.sampled_token_ids for s in steps] == \
        [ev.model_runner_output.sampled_token_ids for ev in original]
