"""Copying a closed capture's chunks into another as the compressed frames they are: how a snapshot joins a ring's
segments.

Why: decoding and encoding every record again sealed ~26 MB a second, so a 512 MB ring took 20 s to answer
`replay snapshot` and held the ring's close as long. A chunk needs none of that. Since format 1.5 a chunk declares
every request-id handle its steps use (`LiveIds` first, then `Ids`), and its logprob columns are its own, so it reads
the same in any capture. Each one is still decompressed once, for zstd's checksum: a damaged chunk is said and left
out, never copied. Only a chunk holding a header or a footer, which the new capture writes itself, is encoded again.
"""

from __future__ import annotations

import msgspec

from replay.capture.format import records as fmt
from replay.capture.format.peek import peek
from replay.capture.reading.damage import Damage
from replay.capture.reading.reader import CaptureReader
from replay.capture.writing.chunk import CopiedChunk, chunk_body
from replay.capture.writing.writer import CaptureWriter

_OWN = ("header", "footer")  # records each capture writes for itself


def splices(reader: CaptureReader) -> bool:
    """Whether `reader`'s chunks can be copied as frames: a closed capture (its index read) of format 1.5 or later,
    whose chunks declare their own handles. Any other is copied record by record."""
    return reader.index is not None and not reader.index.ids and reader.format_version >= (1, 5)


def copy_chunks(reader: CaptureReader, writer: CaptureWriter, *, first: bool = False) -> list[str]:
    """Append every chunk of `reader` (`splices(reader)`) to `writer` (made with `keyframes=0`); returns one line
    for each chunk lost to damage. `first`: the window starts here, so the requests held by the keyframe it opens
    with count among the new capture's (their arrivals are not in it)."""
    lost: list[str] = []
    for ref, data, err in reader.chunk_bytes():
        if err is not None:
            damage = Damage.chunk_lost(ref.number, ref.offset, ref.info, getattr(err, "reason", str(err)))
            lost.append(f"{reader.path.name}: {damage.describe()}")
            continue
        raws = fmt.CHUNK_DECODER.decode(data)
        kept = [r for r in raws if peek(r)[0] not in _OWN]
        if not kept:
            continue
        info = msgspec.structs.replace(ref.info)  # (the writer sets its offset and length)
        if len(kept) == len(raws):
            chunk = CopiedChunk(info, frame=reader.frame(ref))
        else:
            info.num_records = len(kept)
            chunk = CopiedChunk(info, body=chunk_body(kept))
        requests = 0
        if first:  # (a window from step 0 opens with no keyframe: its requests all arrive in it)
            requests, first = _live(kept) if info.keyframe >= 0 else 0, False
        writer.write_chunk(chunk, requests)
    return lost


def _live(raws: list[msgspec.Raw]) -> int:
    """How many requests the chunk's keyframe holds."""
    for r in raws:
        if peek(r)[0] == "keyframe":
            return len(fmt.WIRE_DECODER.decode(r).requests)
    return 0
