"""Delta debugging (Zeller's ddmin): a 1-minimal subset of `items` for which `test` still fails, in O(k log n)
tests for k relevant items instead of 2^n. Written once; `bisect batch` and `bisect config` use it."""

from __future__ import annotations

from typing import Callable, Hashable, Sequence, TypeVar

T = TypeVar("T", bound=Hashable)


class Ddmin:
    """Runs ddmin and counts the tests it needed (each distinct subset is tested once)."""

    def __init__(self, test: Callable[[tuple], bool], log: Callable[[str], None] | None = None):
        self._test = test
        self._cache: dict[frozenset, bool] = {}
        self.log = log or (lambda msg: None)

    @property
    def tests(self) -> int:
        """Distinct subsets tested so far."""
        return len(self._cache)

    def fails(self, subset: Sequence[T]) -> bool:
        """Whether `test` fails on `subset` (cached)."""
        key = frozenset(subset)
        if key not in self._cache:
            self._cache[key] = bool(self._test(tuple(subset)))
            self.log(f"  test {len(self._cache)}: {len(subset)} item(s) -> {'changes it' if self._cache[key] else 'no change'}")
        return self._cache[key]

    def minimize(self, items: Sequence[T]) -> list[T]:
        """A 1-minimal failing subset of `items` (which must fail as a whole)."""
        items = list(items)
        n = 2
        while len(items) >= 2:
            size = -(-len(items) // n)
            chunks = [items[i:i + size] for i in range(0, len(items), size)]
            for c in chunks:
                if self.fails(c):
                    items, n = c, 2
                    break
            else:
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
