"""Logprob columns (format 1.3): a chunk's logprob matrices stored column by column, bit for bit."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zstandard

from replay.capture import CaptureReader, CaptureWriter
from replay.capture.codec.columns import (
    FILTER_COL0_REF,
    FILTER_ROW_DELTA,
    ColumnSink,
    ColumnSource,
)
from replay.capture.format import records as fmt
from replay.capture.format.frames import skippable_frame
from replay.contracts import (
    Array,
    CachedRequestData,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from replay.provenance import make_header


def _lp(rng, n: int, k: int, *, greedy: bool, dtype=np.float32, vocab: int = 50_000) -> tuple[LogprobsLists, list]:
    ids = rng.integers(0, vocab, size=(n, k + 1)).astype(np.int32)
    vals = np.sort(-rng.exponential(2.0, size=(n, k + 1)), axis=1)[:, ::-1].astype(dtype)
    if greedy and k:
        ids[:, 0], vals[:, 0] = ids[:, 1], vals[:, 1]
    elif k >= 3:  # random sampling: the sampled token is sometimes a top-k one, sometimes not
        ids[::3, 0], vals[::3, 0] = ids[::3, 3], vals[::3, 3]
    if n > 2:
        vals[1, -1] = -np.inf  # a masked token
    ranks = rng.integers(1, 9, size=n).astype(np.int64)
    return LogprobsLists(Array.from_numpy(ids), Array.from_numpy(vals),
                         Array.from_numpy(ranks)), [[int(t)] for t in ids[:, 0]]


def _step(index: int, lp: LogprobsLists, sampled: list) -> fmt.Step:
    ids = [f"r{i}" for i in range(len(sampled))]
    so = SchedulerOutput([], CachedRequestData(ids, set(), [], {}, [None] * len(ids), [5] * len(ids), [1] * len(ids)),
                         {r: 1 for r in ids}, len(ids), {}, {}, set(), [])
    return fmt.Step(index, so, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled, lp))


def _bits(lp: LogprobsLists) -> tuple:
    return tuple(a.to_numpy().tobytes() for a in (lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks))


@pytest.mark.parametrize("chunk_bytes", [2_000, 1 << 20])
def test_steps_of_every_kind_read_back_bit_for_bit_in_order_and_one_by_one(tmp_path, chunk_bytes):
    rng = np.random.default_rng(7)
    kinds = [dict(n=8, k=5, greedy=True), dict(n=5, k=5, greedy=False), dict(n=3, k=0, greedy=False),
             dict(n=4, k=1, greedy=True), dict(n=6, k=2, greedy=False), dict(n=7, k=5, greedy=True, dtype=np.float16),
             dict(n=2, k=20, greedy=False, vocab=200_000)]
    steps = [_step(i, *_lp(rng, **kinds[i % len(kinds)])) for i in range(40)]
    path = tmp_path / "c.capture"
    with CaptureWriter(path, make_header("test"), chunk_bytes=chunk_bytes) as w:
        for s in steps:
            w.write_step_record(s)
    with CaptureReader(path) as r:
        got = list(r.steps())
        assert [_bits(s.model_runner_output.logprobs) for s in got] == [_bits(s.model_runner_output.logprobs)
                                                                        for s in steps]
        assert got == steps
        for k in (0, 17, 39):  # random access: one chunk, one step decoded
            assert r.step(k) == steps[k]
        chunks = [c for c in r.index.chunks if c.num_steps]
    assert (len(chunks) > 3) == (chunk_bytes == 2_000)


def test_greedy_columns_store_column_0_as_a_reference_and_sorted_values_as_deltas():
    rng = np.random.default_rng(0)
    sink = ColumnSink()
    lp, _ = _lp(rng, 64, 5, greedy=True)
    marker = sink.add(lp)
    assert marker.logprob_token_ids.data == b"" and marker.logprob_token_ids.shape == (64, 6)
    (group,) = sink.seal().groups
    assert FILTER_COL0_REF in group.token_ids.filters and FILTER_ROW_DELTA in group.logprobs.filters
    stored = np.frombuffer(group.token_ids.data, np.uint8).reshape(4, -1)[:, :64]  # column 0, every byte plane
    assert (stored[0] == 1).all() and not stored[1:].any()  # "the same as column 1"
    assert ColumnSource(fmt.LogprobColumns([group])).fill(marker) == lp


def test_ids_too_large_for_a_reference_are_stored_as_they_are():
    ids = np.array([[2**31 - 1, 5, 2**31 - 1]], np.int32)
    lp = LogprobsLists(Array.from_numpy(ids), Array.from_numpy(np.zeros((1, 3), np.float32)),
                       Array.from_numpy(np.ones(1, np.int64)))
    sink = ColumnSink()
    marker = sink.add(lp)
    (group,) = sink.seal().groups
    assert FILTER_COL0_REF not in group.token_ids.filters
    assert ColumnSource(fmt.LogprobColumns([group])).fill(marker) == lp


def test_a_marker_outside_its_columns_is_damage_of_that_step_not_a_crash(tmp_path):
    rng = np.random.default_rng(1)
    steps = [_step(i, *_lp(rng, 4, 5, greedy=True)) for i in range(3)]
    path = tmp_path / "c.capture"
    with CaptureWriter(path, make_header("test")) as w:
        for s in steps:
            w.write_step_record(s)
    good = CaptureReader(path)
    header, records = good.header, list(good.records())
    good.close()
    # rewrite the chunk by hand: step 1's marker points past the end of its group
    raws = []
    with CaptureReader(path) as r:
        for ref in r.iter_chunks():
            raws += fmt.CHUNK_DECODER.decode(r.read_chunk_bytes(ref))
    recs = [fmt.WIRE_DECODER.decode(x) for x in raws]
    for rec in recs:
        if isinstance(rec, fmt.Step) and rec.index == 1:
            lp = rec.model_runner_output.logprobs
            bad = msgspec.structs.replace(lp.logprob_token_ids, filters=("chunk-column:0:999",))
            rec.model_runner_output.logprobs = msgspec.structs.replace(lp, logprob_token_ids=bad)
    body = msgspec.msgpack.encode([msgspec.Raw(fmt.WIRE_ENCODER.encode(x)) for x in recs
                                   if not isinstance(x, fmt.Footer)])
    prologue = skippable_frame(fmt.PROLOGUE_MAGIC, fmt.PROLOGUE_ID + bytes([fmt.FORMAT_MAJOR, 0, fmt.FORMAT_MINOR, 0]))
    damaged = tmp_path / "d.capture"
    damaged.write_bytes(prologue + zstandard.ZstdCompressor(write_checksum=True,
                                                            write_content_size=True).compress(body))
    with CaptureReader(damaged) as r:
        got = [s.index for s in r.steps()]
        assert got == [0, 2]
        assert any("step 1" in d.reason and "not in their column group" in d.reason for d in r.damage)
    assert header.engine == "test" and len(records) >= 4


def test_a_matrix_whose_bytes_do_not_fit_its_shape_is_refused_before_it_joins_the_columns():
    lp, _ = _lp(np.random.default_rng(1), 4, 5, greedy=True)
    sink = ColumnSink()
    for field, cut in (("logprob_token_ids", 1), ("logprobs", 4), ("sampled_token_ranks", 8)):
        a = getattr(lp, field)
        bad = msgspec.structs.replace(lp, **{field: Array(a.dtype, a.shape, a.data[:-cut])})
        with pytest.raises(ValueError):
            sink.add(bad)
        assert sink.nbytes == 0 and sink.seal() is None
    assert sink.add(lp) is not None and sink.nbytes == sum(len(x.data) for x in (lp.logprob_token_ids, lp.logprobs,
                                                                                 lp.sampled_token_ranks))
