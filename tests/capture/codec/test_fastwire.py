"""The compiled passes (`replay.capture._wire`) store the very bytes the Python passes store, and give way to them
for what they do not take (bools, floats, ints beyond 64 bits), with nothing interned or added twice."""

from __future__ import annotations

import dataclasses
import os
import shutil

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from replay.capture.format import records as fmt
from replay.capture.codec import stepcodec
from replay.capture.codec.columns import ColumnSink
from replay.capture.codec.fastwire import COMPILED, NO_COMPILED_ENV, PYTHON
from replay.capture.format.ids import IdTable
from replay.record.synth import SynthShape, synth_events

ENC = fmt.WIRE_ENCODER.encode
needs_compiled = pytest.mark.skipif(COMPILED is None, reason="replay.capture._wire was not built (no C compiler)")
INT64 = st.integers(-(2**63), 2**64 - 1)  # what msgspec encodes: int64, and uint64 beyond


def test_the_compiled_passes_are_built_where_there_is_a_compiler():
    if os.environ.get(NO_COMPILED_ENV) == "1" or not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here (or REPLAY_NO_COMPILED=1): the Python passes store the same bytes")
    assert COMPILED is not None, "`pip install -e .` did not build replay.capture._wire"


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(st.lists(INT64, max_size=40) | st.sampled_from([list(range(15)), list(range(16)), list(range(70000))]))
def test_ints_encode_as_msgspec_encodes_them(xs):
    assert COMPILED.ints(xs) == msgspec.Raw(ENC(xs))
    assert COMPILED.ints(tuple(xs)) == msgspec.Raw(ENC(xs))
    keys = list(map(str, range(len(xs))))
    assert COMPILED.ordered_values(dict(zip(keys, xs)), keys) == msgspec.Raw(ENC(xs))


@needs_compiled
@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**32), max_size=4), max_size=30))
def test_token_lists_encode_and_count(sampled):
    data, n = COMPILED.tokens(sampled)
    assert data == msgspec.Raw(ENC(sampled)) and n == sum(map(len, sampled))


_INT_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_INT_DTYPES), st.data())
def test_one_token_rows_is_msgspecs_image_of_column_0(dtype, data):
    """The image step's check: true exactly for msgspec's bytes of [[ids[r, 0]] for the rows], on every int width
    and edge of msgpack's forms, whatever the matrix's strides; false for any other bytes."""
    info = np.iinfo(dtype)
    ids = np.array(data.draw(st.lists(st.lists(st.integers(int(info.min), int(info.max)), min_size=2, max_size=2),
                                      min_size=1, max_size=40)), dtype)
    ids = data.draw(st.sampled_from([ids, np.asfortranarray(ids), np.repeat(ids, 2, axis=0)[::2]]))
    row = data.draw(st.integers(0, len(ids)))
    n = data.draw(st.integers(0, len(ids) - row))
    good = ENC([[int(t)] for t in ids[row:row + n, 0]])
    assert COMPILED.one_token_rows(good, ids, row, n)
    assert not COMPILED.one_token_rows(good + b"\x00", ids, row, n)
    if n:
        assert not COMPILED.one_token_rows(good[:-1], ids, row, n)
        assert not COMPILED.one_token_rows(ENC([[int(t)] for t in ids[row:row + n, 0]] + [[0]]), ids, row, n)
        assert not COMPILED.one_token_rows(ENC([[int(t), 0] for t in ids[row:row + n, 0]]), ids, row, n)


@needs_compiled
@pytest.mark.parametrize("ids", [np.zeros(3, np.int64), np.zeros((3, 2), np.float32), np.zeros((3, 2), bool),
                                 np.zeros((3, 2, 1), np.int32)])
def test_one_token_rows_refuses_what_is_not_an_int_matrix(ids):
    with pytest.raises(TypeError):
        COMPILED.one_token_rows(b"\x90", ids, 0, 0)


@needs_compiled
def test_one_token_rows_refuses_rows_beyond_the_matrix():
    with pytest.raises(ValueError):
        COMPILED.one_token_rows(b"\x90", np.zeros((3, 2), np.int32), 2, 2)


@needs_compiled
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**62), 2**62), max_size=20), st.lists(st.integers(-(2**62), 2**62), max_size=20))
def test_differences_encode_as_the_python_pass_stores_them(a, b):
    a, b = a[:len(b)], b[:len(a)]
    assert COMPILED.minus(a, b) == msgspec.Raw(ENC(PYTHON.minus(a, b)))


@needs_compiled
@pytest.mark.parametrize("bad, error", [([True], TypeError), ([1.0], TypeError), ([2**64], OverflowError),
                                        ([-(2**63) - 1], OverflowError), ([[1]], TypeError)])
def test_what_msgspec_would_encode_otherwise_is_refused(bad, error):
    with pytest.raises(error):
        COMPILED.ints(bad)
    with pytest.raises(error):
        COMPILED.tokens([bad])


@needs_compiled
def test_order_and_index_checks_agree_with_python():
    ids = ["a", "b", "c"]
    for d, order in (({"a": 1, "b": 1, "c": 2}, ids), ({"b": 1, "a": 1, "c": 2}, ids), ({"a": 1}, ids),
                     ({"a": 0, "b": 1, "c": 2}, ids), ({}, []), ({"a": 0, "b": 1, "d": 2}, ids),
                     (dict(zip([f"req-{i}" for i in range(3)], range(3))), [f"req-{i}" for i in range(3)])):
        # (the last: keys equal to the order's ids, not the same objects)
        python = PYTHON.ordered_values(d, order)
        assert COMPILED.ordered_values(d, order) == (None if python is None else msgspec.Raw(ENC(python)))
        assert COMPILED.is_index(d, order) == PYTHON.is_index(d, order)
    assert not COMPILED.is_index({"a": 0, "b": 2, "c": 1}, ids)
    for lossy in ({"a": 0, "b": 1.0, "c": 2}, {"a": 0, "b": True, "c": 2}):  # equal to the index, not stored as it
        assert not COMPILED.is_index(lossy, ids) and not PYTHON.is_index(lossy, ids)
    assert not COMPILED.is_index({"a": 0, "b": 1, "c": 2**70}, ids)


def _stored(events, passes) -> tuple[list[bytes], list[int], list[str], list[int]]:
    """Every step of `events` stored as the writer stores it, with one set of passes: records, counts, the id table,
    and the rows each chunk's columns hold."""
    table, sink, records, counts = IdTable(), ColumnSink(), [], []
    for ev in events:
        if ev.request is not None:
            table.handle(ev.request.request_id)
            continue
        step = fmt.Step(ev.step, ev.scheduler_output, ev.model_runner_output)
        if passes is PYTHON:
            wire, n = stepcodec._to_wire(step, table, sink, PYTHON)
        else:
            wire, n = stepcodec.stored_step(step, table, sink)
        records.append(ENC(wire))
        counts.append(n)
    sealed = sink.seal()
    rows = [] if sealed is None else [len(g.ranks.data) for g in sealed.groups]
    return records, counts, table.ids, rows


@needs_compiled
@pytest.mark.parametrize("shape", [SynthShape(steps=60, running=40, num_logprobs=None, seed=3),
                                   SynthShape(steps=40, running=20, num_logprobs=3, seed=5),
                                   SynthShape(steps=30, running=8, prompt_len=(40, 200), num_logprobs=2, seed=7)],
                         ids=["decode, no logprobs", "decode, logprobs", "prefill-heavy"])
def test_steps_store_the_same_bytes_either_way(shape):
    events = list(synth_events(shape))
    assert _stored(events, COMPILED) == _stored(events, PYTHON)


@needs_compiled
def test_a_step_the_compiled_passes_refuse_is_stored_by_the_python_passes_once():
    events = list(synth_events(SynthShape(steps=12, running=6, num_logprobs=2, seed=9)))
    odd = []
    for ev in events:  # a bool among the tokens (msgspec encodes it as true): the C pass refuses the step
        if ev.request is None and ev.model_runner_output is not None and ev.model_runner_output.sampled_token_ids:
            mro = ev.model_runner_output
            sampled = [list(x) for x in mro.sampled_token_ids]
            sampled[0] = [True] + sampled[0][1:] if sampled[0] else [True]
            ev = dataclasses.replace(ev, model_runner_output=replace(mro, sampled_token_ids=sampled))
        odd.append(ev)
    got, want = _stored(odd, COMPILED), _stored(odd, PYTHON)
    assert got == want  # the same records, ids and column rows: nothing interned or added twice
    assert b"\xc3" in b"".join(got[0])


@needs_compiled
def test_the_handles_of_the_same_id_objects_again_are_remembered_and_nothing_else_is():
    table = IdTable()
    ids = [f"req-{i}" for i in range(40)]
    first = COMPILED.handles(ids, table.handle, table.interning)
    assert first == msgspec.Raw(ENC(list(range(40))))
    assert COMPILED.handles(ids, table.handle, table.interning) is first  # the same objects: remembered
    assert COMPILED.handles(tuple(ids), table.handle, table.interning) is first
    ids[3] = "new"  # in place: the same list, another id
    assert COMPILED.handles(ids, table.handle, table.interning) == msgspec.Raw(ENC([0, 1, 2, 40] + list(range(4, 40))))
    rebuilt = [(x + "!")[:-1] for x in ids[::-1]]  # equal strings, other objects, other order
    assert COMPILED.handles(rebuilt, table.handle, table.interning) == msgspec.Raw(ENC([table.handle(x) for x in rebuilt]))
    assert table.ids[40] == "new" and len(table.ids) == 41
    plain = {"a": 7}  # a mapping without the slot: looked up each time
    assert COMPILED.handles(["a"], None, plain) == msgspec.Raw(ENC([7]))
