"""Request ids <-> int handles: a capture stores each id string once (`Ids` records), its steps the handles."""

from __future__ import annotations

from replay.capture.format.records import Ids, LiveIds


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

    def declare_live(self, rec: LiveIds) -> None:
        """Start a chunk of format 1.5 from the handles live when it began (reader side): what came before them
        finished and is not named again, so the table holds the live requests only."""
        self._resolver.clear()
        self._resolver.update(zip(rec.handles, rec.ids))


class _Live(dict):
    """id -> handle of the live requests; a missing id gets the next handle (at C speed, as `_Handles`)."""

    __slots__ = ("table",)

    def __init__(self, table: LiveIdTable):
        super().__init__()
        self.table = table

    def __missing__(self, req_id: str) -> int:
        t = self.table
        h = self[req_id] = t.count
        t.count += 1
        t.new.append(req_id)
        return h


class LiveIdTable:
    """The writer's id table (format 1.5): handles are given in order and never reused, but only the live requests'
    are kept; a finished request's id is dropped (`drop`), so memory follows the requests in flight, not every
    request since the capture began. Each chunk re-declares what is live when its first step is written
    (`live`)."""

    def __init__(self) -> None:
        self.count = 0  # handles given
        self.new: list[str] = []  # ids given handles since the last `take_new`, in handle order
        self.interning = _Live(self)  # str -> int for the live requests; a miss assigns the next handle
        self.handle = self.interning.__getitem__

    def take_new(self) -> Ids | None:
        """An `Ids` record declaring every handle assigned since the last call, or None."""
        if not self.new:
            return None
        new, self.new = self.new, []
        return Ids(self.count - len(new), new)

    def live(self) -> LiveIds | None:
        """A `LiveIds` record of every live handle (those just assigned included, which it declares: they need no
        `Ids` record of their own), or None when none is live."""
        self.new = []
        if not self.interning:
            return None
        return LiveIds(list(self.interning.values()), list(self.interning))

    def drop(self, req_id: str) -> None:
        """Forget a finished request's id (a later use would give it a new handle, declared as new)."""
        self.interning.pop(req_id, None)
