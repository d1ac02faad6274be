"""`recover`: salvage every readable record of a damaged or unfinished capture into a new, indexed one."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from replay.capture.reading.damage import Damage
from replay.capture.reading.reader import CaptureReader
from replay.capture.writing.writer import CaptureWriter
from replay.errors import HeaderLostError, NothingRecoverableError, UsageError


class RecoverResult(msgspec.Struct):
    """What `recover` wrote and what it could not save."""

    source: str
    output: str
    num_steps: int
    num_records: int
    damage: list[Damage]  # what was lost; empty when the input was intact
    unknown_records_dropped: int

    @property
    def lost_data(self) -> bool:
        """True when anything of the input could not be carried over (exit code 3)."""
        return bool(self.damage) or self.unknown_records_dropped > 0


def default_output(src: Path) -> Path:
    """`x.capture.partial` -> `x.capture`; anything else -> `x.recovered.capture`."""
    if src.name.endswith(".partial"):
        return src.with_name(src.name[: -len(".partial")])
    return src.with_name(f"{src.stem}.recovered{src.suffix or '.capture'}")


def recover(src: str | os.PathLike, out: str | os.PathLike | None = None, *, force: bool = False) -> RecoverResult:
    """Rewrite `src` into `out` (default: see `default_output`) with every readable record and a seek index.

    Raises NothingRecoverableError when not even the header can be read, UsageError when `out` exists
    (unless `force`) or is the input itself.
    """
    src = Path(src)
    dst = Path(out) if out is not None else default_output(src)
    try:
        reader = CaptureReader(src)  # first: a missing file or a symlink loop is the input's problem
    except HeaderLostError as e:
        raise NothingRecoverableError(src, f"nothing recoverable: {e.reason}") from None
    with reader:
        if _same(dst, src):
            raise UsageError(f"{dst}: recover writes a new file; choose an output other than the input")
        # Recovering `x.capture.partial` into `x.capture`: the writer's own `.partial` would be the input itself.
        tmp = dst.with_name(dst.name + ".recovering") if _same(dst.with_name(dst.name + ".partial"), src) else None
        # the source's keyframes are copied as they are (a snapshot's first one holds what no record before it does)
        writer = CaptureWriter(dst, reader.header, overwrite=force, partial_path=tmp, keyframes=0)
        try:
            for rec in reader.records(images=True):  # image steps stay images; the writer writes its own Header, Footer
                writer.write_record(rec)
        except BaseException:
            writer.abandon()
            raise
        damage = list(reader.damage)
        lost = "; ".join(d.describe() for d in damage) or "nothing lost"
        old = reader.footer.status if reader.footer is not None else "unfinished"
        writer.close(status=f"recovered from {src.name} ({old}): {lost}"[:1000])
        return RecoverResult(str(src), str(dst), writer.num_steps, writer.num_records, damage, reader.unknown_records)


def _same(a: Path, b: Path) -> bool:
    """Whether two paths name the same file (a path that cannot be resolved names none)."""
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):
        return False
