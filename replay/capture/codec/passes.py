"""The per-request passes of a step's stored form (`stepcodec.step_to_wire`): the batch-order checks, the id
interning, computed minus output tokens, the count of generated tokens. Plain Python builtins (map, list(), ==), so
the stored lists are the step's own: compiled passes would save too little to earn a build step
(docs/performance.md, "The compiled modules")."""

from __future__ import annotations

from collections.abc import Callable
from operator import sub
from typing import Any


class PythonPasses:
    """The passes in Python builtins: the stored lists themselves."""

    @staticmethod
    def ordered_values(d: dict, order: list) -> list[int] | None:
        """The dict's values as stored when its keys, in order, are `order`; else None."""
        return list(d.values()) if len(d) == len(order) and list(d) == order else None

    @staticmethod
    def is_index(index: dict, ids: list) -> bool:
        """Whether `index` is {ids[i]: i}, in that order."""
        if len(index) != len(ids) or list(index) != ids:
            return False
        values = list(index.values())  # ints exactly: 1.0 or True == 1, but would not be stored as they came
        return values == list(range(len(ids))) and all(type(v) is int for v in values)

    @staticmethod
    def minus(done: list[int], out: list[int]) -> list[int]:
        """done[i] - out[i], as stored."""
        return list(map(sub, done, out))

    @staticmethod
    def ints(xs: list[int]) -> list[int]:
        """A list of ints as stored (itself)."""
        return xs

    @staticmethod
    def tokens(sampled: list[list[int]]) -> tuple[list[list[int]], int]:
        """The sampled tokens as stored (themselves) and how many there are."""
        return sampled, sum(map(len, sampled))

    @staticmethod
    def handles(ids: list, intern: Callable[[Any], int], table: dict) -> list[int]:
        """Each id's handle (`intern` assigns new ones; `table` is the mapping it reads)."""
        return list(map(intern, ids)) if ids else ids


PASSES = PythonPasses()
