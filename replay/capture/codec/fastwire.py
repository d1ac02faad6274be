"""The per-request passes of a step's stored form (`stepcodec.step_to_wire`), in two implementations that store the
same bytes: `PYTHON` (builtins: map, list(), ==) and `COMPILED` (`replay.capture._wire`, built with the package; None
where it was not built, or with REPLAY_NO_COMPILED=1).

Why compiled: a 256-request decode step was ~18 passes of 256 elements through Python builtins, most of the ~80 µs a
step capture_bench's builtin write path took. The compiled passes hand back the columns as msgpack (`msgspec.Raw`,
which msgspec's encoder writes as they are), each in one C pass, byte for byte what msgspec writes for the lists.

Each pass is pure but for `handles`, which interns new ids, so a step whose pure passes raise TypeError or
OverflowError (a bool, a float, an int beyond 64 bits: what the compiled passes leave to msgspec) is made again with
the Python passes, from the start, with nothing interned twice.
"""

from __future__ import annotations

import importlib
import os
from operator import sub
from typing import Any, Callable

from msgspec import Raw

# "1": the Python paths only; or the modules to go without, by name ("_emit,_pack"): benchmarks compare the paths
NO_COMPILED_ENV = "REPLAY_NO_COMPILED"


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


class CompiledPasses:
    """The passes in C (`replay.capture._wire`): each column as its msgpack bytes (`msgspec.Raw`)."""

    def __init__(self, c: Any):
        self._c = c
        self.is_index = c.is_index
        # (an image step's check, `image_batch`: whether msgpack bytes are [[ids[r, 0]] for r in row..row+n-1];
        # TypeError for a matrix that is not 2-D integers)
        self.one_token_rows = c.one_token_rows
        # (whether two lists or tuples hold the very same objects in order: `prompts`, a prompt encoded at arrival)
        self.same_items = c.same_items
        self.ints_held = c.int_array_held  # (the list's msgpack, a tuple of the items encoded)

    def ordered_values(self, d: dict, order: list) -> Raw | None:
        """The dict's values, encoded, when its keys in order are `order` (one pass); else None."""
        data = self._c.ordered_values(d, order)
        return None if data is None else Raw(data)

    def minus(self, done: list[int], out: list[int]) -> Raw:
        """[done[i] - out[i]], encoded."""
        return Raw(self._c.diff_array(done, out))

    def ints(self, xs: list[int]) -> Raw:
        """The list of ints, encoded."""
        return Raw(self._c.int_array(xs))

    def tokens(self, sampled: list[list[int]]) -> tuple[Raw, int]:
        """The sampled tokens, encoded, and how many there are."""
        data, n = self._c.token_lists(sampled)
        return Raw(data), n

    def handles(self, ids: list, intern: Callable[[Any], int], table: dict) -> Raw | list:
        """Each id's handle, encoded (a miss in `table` interns, as `intern` would). A table with a `last` slot
        (`ids._Handles`) remembers the last list: the very same id objects again are the very same handles (a handle
        never changes once given), found by a memcmp of item pointers instead of a lookup each."""
        if not ids:
            return ids
        last = getattr(table, "last", False)
        if last and self._c.same_items(ids, last[0]):
            return last[1]
        data = Raw(self._c.handle_array(ids, table))
        if last is not False:
            table.last = (tuple(ids), data)  # (held: an id freed and its address reused would not be the same id)
        return data


PYTHON = PythonPasses()


def load_compiled(name: str) -> Any:
    """The compiled module `replay.capture.<name>` ("codec._wire"), or None where it was not built (no C compiler:
    each user takes its Python path, which stores the same records), with REPLAY_NO_COMPILED=1, or where that names
    it ("_wire")."""
    off = os.environ.get(NO_COMPILED_ENV, "")
    if off == "1" or name.rpartition(".")[2] in {n.strip() for n in off.split(",")}:
        return None
    try:
        return importlib.import_module(f"replay.capture.{name}")
    except ImportError:
        return None


_wire = load_compiled("codec._wire")
COMPILED = None if _wire is None else CompiledPasses(_wire)
