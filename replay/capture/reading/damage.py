"""`Damage`: one place where a capture's data could not be read, as the reader, `info` and `recover` report it."""

from __future__ import annotations

import msgspec

from replay.capture.format.records import ChunkInfo


class Damage(msgspec.Struct, omit_defaults=True):
    """One place where data could not be read. `kind`: chunk | truncated | garbage | record | unfinished | index."""

    kind: str
    reason: str
    chunk: int | None = None  # chunk number (0 = the header chunk)
    offset: int | None = None  # byte offset in the file
    first_step: int | None = None  # steps known (from the index) to be lost with it
    last_step: int | None = None

    @classmethod
    def chunk_lost(cls, number: int, offset: int, info: ChunkInfo | None, reason: str) -> Damage:
        """A chunk that could not be read, with the steps its index entry (when there is one) says it held."""
        steps = info is not None and info.num_steps > 0
        return cls("chunk", reason, chunk=number, offset=offset, first_step=info.first_step if steps else None,
                   last_step=info.last_step if steps else None)

    def describe(self) -> str:
        """One line for humans."""
        where = []
        if self.chunk is not None:
            where.append(f"chunk {self.chunk}")
        if self.offset is not None:
            where.append(f"byte {self.offset}")
        lost = ""
        if self.first_step is not None:
            lost = (f"; steps {self.first_step}-{self.last_step} lost" if self.last_step != self.first_step
                    else f"; step {self.first_step} lost")
        return f"{' '.join(where) + ': ' if where else ''}{self.reason}{lost}"
