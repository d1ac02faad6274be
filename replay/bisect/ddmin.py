"""Delta debugging (Zeller's ddmin): a 1-minimal subset of `items` for which `test` still fails, in O(k log n)
tests for k relevant items instead of 2^n. Written once; `bisect batch` and `bisect config` use it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TypeVar

from replay.errors import UsageError

T = TypeVar("T", bound=Hashable)


class Ddmin:
    """Runs ddmin and counts the tests it needed (each distinct subset is tested once).

    With `state`, every test result is also written to that JSON file as soon as it is known, and read back on
    the next run: an interrupted bisect resumes where it stopped instead of re-executing everything.

    With `many` (test a list of subsets at once, e.g. fanned out over processes or Ray), each round's candidate
    subsets are tested together before the round's decisions are taken, from the same cached answers in the same
    order: the result is the serial one, at the price of testing a round's later subsets too."""

    def __init__(self, test: Callable[[tuple], bool], log: Callable[[str], None] | None = None,
                 state: str | os.PathLike | None = None,
                 many: Callable[[list[tuple]], list[bool]] | None = None):
        self._test = test
        self._many = many
        self._cache: dict[frozenset, bool] = {}
        self.log = log or (lambda msg: None)
        self._state = Path(state) if state else None
        self.resumed = 0
        if self._state is not None and self._state.exists():
            try:
                saved = json.loads(self._state.read_text())
                for items, result in saved["tests"]:
                    self._cache[frozenset(_hashable(x) for x in items)] = bool(result)
            except (ValueError, KeyError, TypeError):
                raise UsageError(f"{self._state}: not a bisect state file (delete it to start over)") from None
            self.resumed = len(self._cache)
            self.log(f"  resuming: {self.resumed} test result(s) read from {self._state}")

    def _save(self) -> None:
        if self._state is None:
            return
        data = {"tests": [[sorted(map(list, k) if k and isinstance(next(iter(k)), tuple) else k), v]
                          for k, v in self._cache.items()]}
        tmp = self._state.with_name(self._state.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self._state)  # atomic: a kill never leaves half a state file

    @property
    def tests(self) -> int:
        """Distinct subsets tested so far."""
        return len(self._cache)

    def fails(self, subset: Sequence[T]) -> bool:
        """Whether `test` fails on `subset` (cached)."""
        key = frozenset(subset)
        if key not in self._cache:
            self._cache[key] = bool(self._test(tuple(subset)))
            self._save()
            said = "changes it" if self._cache[key] else "no change"
            self.log(f"  test {len(self._cache)}: {len(subset)} item(s) -> {said}")
        return self._cache[key]

    def prefetch(self, subsets: Sequence[Sequence[T]]) -> None:
        """Test the uncached ones of `subsets` together (with `many`; without it, nothing happens here)."""
        if self._many is None:
            return
        todo = list({frozenset(s): tuple(s) for s in subsets if frozenset(s) not in self._cache}.values())
        if len(todo) < 2:
            return
        for subset, result in zip(todo, self._many(todo)):
            self._cache[frozenset(subset)] = bool(result)
            self.log(f"  test {len(self._cache)}: {len(subset)} item(s) -> {'changes it' if result else 'no change'}")
        self._save()

    def minimize(self, items: Sequence[T]) -> list[T]:
        """A 1-minimal failing subset of `items` (which must fail as a whole)."""
        items = list(items)
        n = 2
        while len(items) >= 2:
            size = -(-len(items) // n)
            chunks = [items[i:i + size] for i in range(0, len(items), size)]
            self.prefetch(chunks)
            for c in chunks:
                if self.fails(c):
                    items, n = c, 2
                    break
            else:
                self.prefetch([r for r in ([x for x in items if x not in c] for c in chunks) if r])
                for c in chunks:
                    rest = [x for x in items if x not in c]
                    if rest and self.fails(rest):
                        items, n = rest, max(n - 1, 2)
                        break
                else:
                    if n >= len(items):
                        break
                    n = min(len(items), 2 * n)
        return items


def _hashable(x):
    """JSON gives lists back where we stored tuples (knob changes): turn them into tuples again."""
    return tuple(x) if isinstance(x, list) else x
