"""`StepRange`: which steps a command works on (`--step 57`, `--steps 10-20`, `10-` to the end)."""

from __future__ import annotations

import re

import msgspec

from replay.errors import UsageError


class StepRange(msgspec.Struct, frozen=True):
    """Inclusive step range; `last` None = to the end."""

    first: int
    last: int | None

    @classmethod
    def parse(cls, text: str, flag: str = "--steps") -> StepRange:
        """`57`, `10-20` or `10-` (to the end); anything else is a UsageError naming `flag`."""
        m = re.fullmatch(r"\s*(\d+)\s*(?:(-)\s*(\d+)?)?\s*", text)
        if not m:
            raise UsageError(f"{flag} {text!r}: expected N, A-B or A- (step numbers)")
        first = int(m.group(1))
        last = first if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
        if last is not None and last < first:
            raise UsageError(f"{flag} {text!r}: the range ends before it starts")
        return cls(first, last)

    def __contains__(self, index: int) -> bool:
        return index >= self.first and (self.last is None or index <= self.last)

    def __str__(self) -> str:
        return f"{self.first}-{'' if self.last is None else self.last}"
