"""Image steps with outputs in parts, finished per chunk (`PartsBatch`): the same records, byte for byte, as the
step-by-step route (`store_step_image`), whatever the step's tokens look like."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from replay.capture import CaptureReader, CaptureWriter
from replay.capture.codec.step_image import OutputParts
from replay.capture.format import records as fmt
from replay.capture.writing import image_batch
from replay.errors import UsageError
from replay.inspect import capture_info
from replay.provenance import make_header
from replay.record.synth import SynthShape, synth_events
from tests.images import as_map, as_parts

ENC = msgspec.msgpack.Encoder()


def _parts(sampled: list[list[int]], ids: np.ndarray, cu: list[int] | None = None, tokens: bytes | None = None):
    rows, k = ids.shape
    vals = -np.arange(rows * k, dtype=np.float32).reshape(rows, k) / 7
    return OutputParts(ENC.encode({"req_ids": [f"r{i}" for i in range(len(sampled))]}),
                       ENC.encode(sampled) if tokens is None else tokens, ("int32", "float32", "int64"), (rows, k), cu,
                       (ids.astype(np.int32).tobytes(), vals.tobytes(), np.arange(rows, dtype=np.int64).tobytes()))


def _cases() -> list[OutputParts]:
    """Steps whose sampled tokens repeat column 0 one per row (ids across msgpack's int widths, 20 rows: a 16-bit
    array header), a partial prefill's empty row, a token not in column 0, several tokens per request, and two K."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1 << 20, (20, 4))
    ids[:8, 0] = [0, 127, 128, 255, 256, 65535, 65536, (1 << 20) - 1]
    col0 = ids[:, 0]
    small = rng.integers(0, 100, (3, 2))
    return [
        _parts([[int(t)] for t in col0], ids),
        _parts([[int(small[0, 0])], [], [int(small[2, 0])]], small),
        _parts([[int(small[0, 0])], [int(small[1, 0]) + 1], [int(small[2, 0])]], small),
        _parts([[int(col0[0]), int(col0[1])], [int(col0[2])]], ids[:3], cu=[0, 2, 3]),
        _parts([[int(t)] for t in col0[:5]], ids[:5, :3]),
        _parts([[-1], [int(small[1, 0])]], np.array([[-1, 4], [int(small[1, 0]), 5]])),  # (checked step by step)
    ]


def _write(path, steps, *, batched: bool, monkeypatch, chunk_bytes: int = 1 << 20):
    with monkeypatch.context() as m:
        if not batched:  # the step-by-step route, as before batching
            m.setattr(image_batch.PartsBatch, "add", lambda *a, **k: None)
        with CaptureWriter(path, make_header("test"), chunk_bytes=chunk_bytes) as w:
            for i, (so, mro) in enumerate(steps):
                w.write_step_image(i, so, mro, None, fmt.StepTiming(i, 2, 3, 4))
    return path


def _bodies(path) -> list[bytes]:
    with CaptureReader(path) as r:
        return [r.read_chunk_bytes(ref) for ref in r.iter_chunks()][1:]  # (the first holds the header)


def _figures(path):
    i = capture_info(path)
    return i.num_steps, i.num_generated_tokens, i.num_scheduled_tokens


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 600])
def test_batched_steps_are_stored_byte_for_byte_as_step_by_step(tmp_path, monkeypatch, chunk_bytes):
    so = ENC.encode({"total_num_scheduled_tokens": 5})
    steps = [(so, p) for p in _cases()] * 2
    steps.insert(3, (so, ENC.encode({"req_ids": ["w"], "sampled_token_ids": [[9]]})))  # a whole image among them
    a = _write(tmp_path / "a.capture", steps, batched=True, monkeypatch=monkeypatch, chunk_bytes=chunk_bytes)
    b = _write(tmp_path / "b.capture", steps, batched=False, monkeypatch=monkeypatch, chunk_bytes=chunk_bytes)
    if chunk_bytes > 1000:  # one chunk each; small chunks close at other steps (a set-aside step's size is a guess)
        assert _bodies(a) == _bodies(b)
    else:
        assert len(_bodies(a)) >= 3
    assert _figures(a) == _figures(b) == (13, 2 * (20 + 2 + 3 + 3 + 5 + 2) + 1, 65)
    with CaptureReader(a) as r, CaptureReader(b) as r2:
        got = list(r.steps())
        assert got == list(r2.steps())
    assert [s.model_runner_output.sampled_token_ids for s in got] == \
        [msgspec.msgpack.decode(p.tokens) if isinstance(p, OutputParts) else [[9]] for _, p in steps]


def test_a_synthetic_run_sent_in_parts_reads_back_as_its_steps(tmp_path, monkeypatch):
    wl = SynthShape(steps=30, running=20, prompt_len=(4, 40), output_len=(3, 20), num_logprobs=4, vocab_size=300,
                    seed=8)
    events = [ev for ev in synth_events(wl) if ev.request is None]
    steps = [(ENC.encode(as_map(ev.scheduler_output)), as_parts(ev.model_runner_output)) for ev in events]
    a = _write(tmp_path / "a.capture", steps, batched=True, monkeypatch=monkeypatch, chunk_bytes=20_000)
    b = _write(tmp_path / "b.capture", steps, batched=False, monkeypatch=monkeypatch, chunk_bytes=20_000)
    assert _bodies(a) == _bodies(b) and _figures(a) == _figures(b)
    with CaptureReader(a) as r:
        assert [s.model_runner_output.logprobs for s in r.steps()] == [ev.model_runner_output.logprobs for ev in events]


def test_the_chunks_one_token_images_are_msgspecs_own():
    """The per-chunk images that a step's sampled tokens are compared with are what msgspec makes of `[t]`, at every
    int width; a token msgpack would store otherwise (negative, beyond 32 bits) leaves the check to each step."""
    rng = np.random.default_rng(5)
    edges = [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1]
    col0 = np.array(edges + list(rng.integers(0, 1 << 32, 300)) + list(rng.integers(0, 300, 300)), np.int64)
    images, offsets = image_batch.one_token_each_images(col0)
    assert [images[a:b] for a, b in zip(offsets, offsets[1:])] == [ENC.encode([int(t)]) for t in col0]
    assert image_batch.one_token_each_images(np.array([3, -1])) is None
    assert image_batch.one_token_each_images(np.array([1 << 32])) is None


@pytest.mark.parametrize("tokens", [ENC.encode([["five"], ["seven"]]), ENC.encode("x")])
def test_tokens_of_another_shape_are_kept_as_sent(tmp_path, monkeypatch, tokens):
    """No engine's tap sends these, but the writer must neither fall over nor lose them."""
    ids = np.array([[5, 6], [7, 8]])
    steps = [(ENC.encode({"total_num_scheduled_tokens": 2}), _parts([[5], [7]], ids)),
             (ENC.encode({"total_num_scheduled_tokens": 2}), _parts([[5], [7]], ids, tokens=tokens))]
    a = _write(tmp_path / "a.capture", steps, batched=True, monkeypatch=monkeypatch)
    b = _write(tmp_path / "b.capture", steps, batched=False, monkeypatch=monkeypatch)
    assert _bodies(a) == _bodies(b) and _figures(a) == _figures(b)  # counted by the tolerant reading, as ever
    with CaptureReader(a) as r:
        stored = [fmt.WIRE_DECODER.decode(x) for ref in r.iter_chunks()
                  for x in fmt.CHUNK_DECODER.decode(r.read_chunk_bytes(ref))]
    images = [msgspec.msgpack.decode(x.model_runner_output) for x in stored if isinstance(x, fmt.StepImage)]
    assert isinstance(images[0]["sampled_token_ids"], dict)  # the reference to column 0
    assert images[1]["sampled_token_ids"] == msgspec.msgpack.decode(tokens)


@pytest.mark.parametrize("part", ["rest", "tokens"])
def test_parts_that_are_not_msgpack_are_refused_when_written(tmp_path, part):
    parts = _parts([[5]], np.array([[5, 6]]))._replace(**{part: b"\x81\xc1"})
    with CaptureWriter(tmp_path / "x.capture", make_header("test")) as w:
        with pytest.raises(UsageError, match="cannot record step 0"):
            w.write_step_image(0, ENC.encode({"total_num_scheduled_tokens": 1}), parts)


def test_steps_with_drafts_take_the_step_by_step_route(tmp_path, monkeypatch):
    """Verified drafts are counted on the whole image, so such a step is not set aside."""
    so = ENC.encode({"total_num_scheduled_tokens": 2, "scheduled_spec_decode_tokens": {"r0": [1]}})
    batch = image_batch.PartsBatch()
    from replay.capture.codec.columns import ColumnSink

    assert batch.add(0, so, _parts([[5]], np.array([[5, 1]])), None, None, ColumnSink()) is None and not len(batch)


def test_a_step_over_the_record_limit_is_refused_by_name_not_set_aside(tmp_path, monkeypatch):
    """Set aside, it would be encoded only at the seal, past the check that keeps records readable."""
    monkeypatch.setattr(fmt, "MAX_RECORD_BYTES", 6000)
    big = _parts([[5]], np.array([[5, 6]]))._replace(rest=ENC.encode({"req_ids": ["r" * 7000]}))
    with CaptureWriter(tmp_path / "x.capture", make_header("test")) as w:
        w.write_step_image(0, ENC.encode({"total_num_scheduled_tokens": 1}), _parts([[5]], np.array([[5, 6]])))
        with pytest.raises(UsageError, match="exceeds the 6000-byte limit"):
            w.write_step_image(1, ENC.encode({"total_num_scheduled_tokens": 1}), big)
    assert _figures(tmp_path / "x.capture")[0] == 1
