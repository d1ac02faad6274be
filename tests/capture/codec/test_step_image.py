"""StepImage records (format 1.3): steps stored as another engine's images read back as the steps they stand for."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from replay.capture import CaptureReader, CaptureWriter
from replay.capture.format import records as fmt
from replay.contracts import ModelRunnerOutput
from replay.errors import UsageError
from replay.inspect import capture_info
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events
from replay.report.run_facts import run_facts
from tests.images import as_map, as_parts

WL = SynthShape(steps=40, running=6, prompt_len=(4, 40), output_len=(3, 20), num_logprobs=3, vocab_size=1000, seed=4)
ENC = msgspec.msgpack.Encoder()


def _write(path, *, images: bool | str, chunk_bytes: int = 3000):
    """images: False (contracts), True (whole images), "parts" (outputs with their logprob matrices apart)."""
    with CaptureWriter(path, make_header("test"), chunk_bytes=chunk_bytes) as w:
        for ev in synth_events(WL):
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
            elif images:
                mro = (as_parts(ev.model_runner_output) if images == "parts"
                       else ENC.encode(as_map(ev.model_runner_output)))
                w.write_step_image(ev.step, ENC.encode(as_map(ev.scheduler_output)), mro, None,
                                   fmt.StepTiming(1, 2, 3, 4))
            else:
                w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output, timing=fmt.StepTiming(1, 2, 3, 4))


@pytest.mark.parametrize("images", [True, "parts"])
def test_image_steps_read_back_as_the_steps_the_contract_route_stores(tmp_path, images):
    _write(tmp_path / "c.capture", images=False)
    _write(tmp_path / "i.capture", images=images)
    with CaptureReader(tmp_path / "c.capture") as a, CaptureReader(tmp_path / "i.capture") as b:
        expected, got = list(a.records()), list(b.records())
        assert got[1:-1] == expected[1:-1] and not b.damage  # the header's creation time differs
        for k in (0, 21, WL.steps - 1):  # random access decodes one chunk, one image
            assert b.step(k) == a.step(k)
        stored = [fmt.WIRE_DECODER.decode(x) for ref in b.iter_chunks()
                  for x in fmt.CHUNK_DECODER.decode(b.read_chunk_bytes(ref))]
    assert sum(isinstance(x, fmt.StepImage) for x in stored) == WL.steps
    assert sum(isinstance(x, fmt.LogprobColumns) for x in stored) > 1  # one per chunk that has logprobs
    assert (tmp_path / "i.capture").read_bytes().endswith(fmt.INDEX_TRAILER_ZSTD)  # 1.3: the index is compressed
    ci, ii = capture_info(tmp_path / "c.capture"), capture_info(tmp_path / "i.capture")
    assert (ii.num_steps, ii.num_generated_tokens, ii.num_scheduled_tokens) == \
        (ci.num_steps, ci.num_generated_tokens, ci.num_scheduled_tokens)


def test_the_report_reads_image_steps_as_it_reads_stored_steps(tmp_path):
    _write(tmp_path / "c.capture", images=False)
    _write(tmp_path / "i.capture", images=True)
    a, b = run_facts(tmp_path / "c.capture"), run_facts(tmp_path / "i.capture")
    assert not b.damage and np.array_equal(a.index, b.index)
    assert {k: v.tolist() for k, v in a.series.items()} == {k: v.tolist() for k, v in b.series.items()}
    assert a.requests == b.requests and a.timed == b.timed == WL.steps


def test_an_image_that_is_not_msgpack_is_refused_by_name(tmp_path):
    with CaptureWriter(tmp_path / "x.capture", make_header("test")) as w:
        with pytest.raises(UsageError, match="cannot record step 0"):
            w.write_step_image(0, b"\xc1not msgpack", None)


@pytest.mark.parametrize("parts", [False, True])
@pytest.mark.parametrize("case", ["one row per token", "a partial prefill's row", "not the sampled token"])
def test_sampled_tokens_are_read_from_the_logprob_rows_only_when_those_hold_them(tmp_path, case, parts):
    """vLLM puts the sampled token in logprob column 0: then the image keeps only where to find them."""
    from replay.capture.codec.columns import ColumnSink, ColumnSource
    from replay.capture.codec.step_image import OutputParts, restore_output
    from replay.contracts import Array, LogprobsLists
    from replay.contracts.image_decoder import ImageDecoder

    ids = np.array([[7, 7, 3], [9, 1, 9], [4, 4, 8]], np.int32)
    sampled = {"one row per token": [[7], [9], [4]], "a partial prefill's row": [[7], [], [4]],
               "not the sampled token": [[7], [9], [5]]}[case]
    lp = LogprobsLists(Array.from_numpy(ids), Array.from_numpy(-np.ones((3, 3), np.float32)),
                       Array.from_numpy(np.ones(3, np.int64)))
    image = ENC.encode({"req_ids": ["a", "b", "c"], "sampled_token_ids": sampled, "logprobs": lp})
    if parts:  # as the vLLM tap sends it: the matrices apart
        image = OutputParts(ENC.encode({"req_ids": ["a", "b", "c"]}), ENC.encode(sampled),
                            ("int32", "float32", "int64"),
                            (3, 3), None, (lp.logprob_token_ids.data, lp.logprobs.data, lp.sampled_token_ranks.data))
    sink = ColumnSink()
    rec, stats = _store(image, sink)
    stored = msgspec.msgpack.decode(rec.model_runner_output)["sampled_token_ids"]
    assert isinstance(stored, dict) == (case != "not the sampled token")
    restored, lists = restore_output(rec.model_runner_output, ColumnSource(sink.seal()))
    assert msgspec.msgpack.decode(restored)["sampled_token_ids"] == sampled and lists == lp
    assert stats.generated == sum(map(len, sampled))
    assert ImageDecoder().decode(restored, ModelRunnerOutput[str]).sampled_token_ids == sampled


def _store(mro_image: bytes, sink):
    from replay.capture.codec.step_image import store_step_image
    from replay.contracts.image_decoder import ImageDecoder

    return store_step_image(0, ENC.encode({"total_num_scheduled_tokens": 3}), mro_image, None, None, sink,
                            ImageDecoder())


def test_output_parts_that_do_not_fit_their_shape_are_refused_by_name(tmp_path):
    from replay.capture.codec.step_image import OutputParts

    parts = OutputParts(ENC.encode({"req_ids": ["a"]}), ENC.encode([[7]]), ("int32", "float32", "int64"), (1, 3), None,
                        (b"\0" * 12, b"\0" * 12, b"\0" * 7))  # ranks: 7 bytes for one int64
    with CaptureWriter(tmp_path / "x.capture", make_header("test")) as w:
        with pytest.raises(UsageError, match="cannot record step 0"):
            w.write_step_image(0, ENC.encode({"total_num_scheduled_tokens": 1}), parts)
