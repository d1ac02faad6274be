"""Request ids <-> int handles: a capture stores each id string once (`Ids` records), its steps the handles."""

from __future__ import annotations

from replay.capture.format.records import Ids


class UnknownHandleError(KeyError):
    """A stored step refers to a request-id handle whose `Ids` record was never read (it sat in a lost chunk)."""


class _Handles(dict):
    """id -> handle; a missing id gets the next handle, so `dict.__getitem__` interns at C speed in `map`."""

    __slots__ = ("ids",)

    def __init__(self, ids: list[str]):
        super().__init__((s, i) for i, s in enumerate(ids))
        self.ids = ids

    def __missing__(self, req_id: str) -> int:
        h = self[req_id] = len(self.ids)
        self.ids.append(req_id)
        return h


class _Resolver(dict):
    """handle -> id; a handle never declared raises UnknownHandleError."""

    __slots__ = ()

    def __missing__(self, h: int) -> str:
        raise UnknownHandleError(h)


class IdTable:
    """Request id <-> handle, handles given in order of first appearance."""

    def __init__(self, ids: list[str] | None = None):
        self.ids: list[str] = []
        self._handles = _Handles(self.ids)
        self._resolver = _Resolver()
        for s in ids or []:
            self._handles[s]
        self._resolver.update(enumerate(self.ids))
        self._pending_first = len(self.ids)
        self.interning = self._handles  # str -> int mapping; a miss assigns the next handle
        self.handle = self._handles.__getitem__  # str -> int, assigning new handles
        self.resolve = self._resolver.__getitem__  # int -> str, UnknownHandleError if undeclared

    def take_new(self) -> Ids | None:
        """An `Ids` record declaring every handle assigned since the last call, or None."""
        first = self._pending_first
        if first == len(self.ids):
            return None
        self._pending_first = len(self.ids)
        new = self.ids[first:]
        self._resolver.update(enumerate(new, first))
        return Ids(first, new)

    def declare(self, rec: Ids) -> None:
        """Learn the handles an `Ids` record declares (reader side). Gaps from lost chunks stay unknown."""
        self._resolver.update(enumerate(rec.ids, rec.first))
