"""The compiled packing of a chunk's logprob column group (`_pack.c`) stores the numpy path's very bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.capture.codec import columns
from replay.capture.codec.columns import PACK_GROUP, _pack, _pack_numpy
from replay.contracts.arrays import NUMPY_DTYPES

pytestmark = pytest.mark.skipif(PACK_GROUP is None, reason="replay.capture._pack was not built (no C compiler)")

ID_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "int64"]
VALUE_DTYPES = ["float16", "bfloat16", "float32", "float64"]
RANK_DTYPES = ["int8", "int16", "int32", "int64"]


def _matrices(rng, rows: int, k: int, id_dtype: str, val_dtype: str, rank_dtype: str, *, vocab: int):
    """Row-major matrices as the sink joins them (little-endian, C order), with column 0 repeating a top-k column in
    most rows, as a sampler's logprobs do."""
    dt = np.dtype(NUMPY_DTYPES[id_dtype])
    info = np.iinfo(dt)
    ids = rng.integers(max(info.min, -vocab), min(info.max, vocab) + 1, size=(rows, k), dtype=np.int64).astype(dt)
    same = rng.integers(0, k, size=rows)  # 0: column 0 holds its own token
    hit = same > 0
    ids[hit, 0] = ids[hit, same[hit]]
    bits = np.dtype(NUMPY_DTYPES[val_dtype])
    vals = rng.integers(0, 256, size=(rows, k * bits.itemsize), dtype=np.uint8).view(bits).reshape(rows, k)
    if val_dtype not in ("bfloat16",):
        vals[hit, 0] = vals[hit, same[hit]]  # (the very same value: column 0 XOR its column is zeros)
    rank = np.dtype(NUMPY_DTYPES[rank_dtype])
    ranks = rng.integers(0, min(np.iinfo(rank).max, 1 << 20), size=rows).astype(rank)
    return ids, vals, ranks


def _same(kind, ids, vals, ranks):
    assert _pack(kind, ids, vals, ranks) == _pack_numpy(kind, ids, vals, ranks)


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("val_dtype", VALUE_DTYPES)
@pytest.mark.parametrize("k", [2, 3, 6])
def test_every_dtype_and_width_packs_the_numpy_bytes(id_dtype, val_dtype, k):
    rng = np.random.default_rng(k)
    for rank_dtype in RANK_DTYPES:
        for vocab in (100, 60_000, 1 << 40):  # ids that shuffle (all < 2^16) and ids that do not
            ids, vals, ranks = _matrices(rng, 97, k, id_dtype, val_dtype, rank_dtype, vocab=vocab)
            _same((id_dtype, val_dtype, rank_dtype, k), ids, vals, ranks)


def test_column_0_at_the_dtype_edges_packs_the_numpy_bytes():
    """Where col0-ref does not apply (a negative id, or id + K beyond the dtype) and where it just does."""
    rng = np.random.default_rng(0)
    for id_dtype in ID_DTYPES:
        info = np.iinfo(np.dtype(NUMPY_DTYPES[id_dtype]))
        for edge in sorted({info.min, max(info.min, -1), 0, info.max - 6, info.max - 5, info.max}):
            ids, vals, ranks = _matrices(rng, 40, 6, id_dtype, "float32", "int64", vocab=1000)
            ids[7, 0] = edge  # (a token no other column holds)
            ids[7, 1:] = 3
            _same((id_dtype, "float32", "int64", 6), ids, vals, ranks)


def test_a_real_sink_seals_the_same_record_compiled_or_not(monkeypatch):
    """The whole chunk record, from a sink fed like the writer feeds it."""
    from replay.capture.format import records as fmt
    from replay.record.synth import SynthShape, synth_events

    def sealed():
        sink = columns.ColumnSink()
        for ev in synth_events(SynthShape(steps=40, running=24, num_logprobs=5, seed=5)):
            if ev.request is None and ev.model_runner_output.logprobs is not None:
                sink.add(ev.model_runner_output.logprobs)
        return fmt.WIRE_ENCODER.encode(sink.seal())

    compiled = sealed()
    monkeypatch.setattr(columns, "PACK_GROUP", None)
    assert sealed() == compiled


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 30), k=st.integers(2, 8), id_dtype=st.sampled_from(ID_DTYPES),
       val_dtype=st.sampled_from(VALUE_DTYPES), rank_dtype=st.sampled_from(RANK_DTYPES),
       seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([2, 300, 70_000, 1 << 62]))
def test_any_matrices_pack_the_numpy_bytes(rows, k, id_dtype, val_dtype, rank_dtype, seed, vocab):
    ids, vals, ranks = _matrices(np.random.default_rng(seed), rows, k, id_dtype, val_dtype, rank_dtype, vocab=vocab)
    _same((id_dtype, val_dtype, rank_dtype, k), ids, vals, ranks)


def test_matrices_that_do_not_fit_their_shape_are_refused():
    ids = np.zeros((4, 3), np.int32)
    with pytest.raises(ValueError):
        PACK_GROUP(ids.data, b"\0" * 47, b"\0" * 32, 4, 3, 4, True, 4, 8)
