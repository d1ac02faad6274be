"""The per-request passes of a step's stored form (`replay.capture.codec.passes`): a column is stored as the
dict's values or left out only when the order it implies is exactly the batch order, with ints stored as they came."""

from __future__ import annotations

from replay.capture.codec.passes import PASSES


def test_values_are_taken_in_batch_order_only_when_the_keys_are_that_order():
    ids = ["a", "b", "c"]
    assert PASSES.ordered_values({"a": 1, "b": 1, "c": 2}, ids) == [1, 1, 2]
    assert PASSES.ordered_values({"b": 1, "a": 1, "c": 2}, ids) is None
    assert PASSES.ordered_values({"a": 1}, ids) is None
    assert PASSES.ordered_values({}, []) == []


def test_an_index_is_implied_only_by_exact_ints_in_order():
    ids = ["a", "b", "c"]
    assert PASSES.is_index({"a": 0, "b": 1, "c": 2}, ids)
    assert not PASSES.is_index({"a": 0, "b": 2, "c": 1}, ids)
    assert not PASSES.is_index({"a": 0, "b": 1, "d": 2}, ids)
    for lossy in ({"a": 0, "b": 1.0, "c": 2}, {"a": 0, "b": True, "c": 2}):  # equal to the index, not stored as it
        assert not PASSES.is_index(lossy, ids)


def test_counts_and_handles():
    assert PASSES.minus([5, 7], [2, 3]) == [3, 4]
    assert PASSES.tokens([[1], [2, 3], []]) == ([[1], [2, 3], []], 3)
    table: dict = {}
    assert PASSES.handles(["x", "y", "x"], lambda rid: table.setdefault(rid, len(table)), table) == [0, 1, 0]
