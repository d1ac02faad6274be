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
from replay.capture.format.keyframe import Keyframe
from replay.capture.format.peek import peek
from replay.capture.reading.damage import Damage
from replay.capture.reading.reader import CaptureReader, ChunkRef
from replay.capture.writing.chunk import CopiedChunk, chunk_body
from replay.capture.writing.writer import CaptureWriter

_OWN = ("header", "footer")  # records each capture writes for itself
_KEYFRAME = msgspec.msgpack.Decoder(Keyframe)


def splices(reader: CaptureReader) -> bool:
    """Whether `reader`'s chunks can be copied as frames: a closed capture (its index read) of format 1.5 or later,
    whose chunks declare their own handles. Any other is copied record by record."""
    return reader.index is not None and not reader.index.ids and reader.format_version >= (1, 5)


def copy_chunks(reader: CaptureReader, writer: CaptureWriter) -> list[str]:
    """Append every chunk of `reader` (`splices(reader)`) to `writer` (made with `keyframes=0`); returns one line
    for each chunk lost to damage. A keyframe before the writer's first step (the window opens with it) holds
    requests whose arrivals are not in the new capture: they count among its requests, as `write_keyframe`'s do."""
    lost: list[str] = []
    for ref, data, err in reader.chunk_bytes():
        if err is not None:
            lost.append(_lost(reader, ref, getattr(err, "reason", str(err))))
            continue
        try:
            raws = fmt.CHUNK_DECODER.decode(data)
            requests = _live(raws) if ref.info.keyframe >= 0 and not writer.num_steps else 0
        except (msgspec.DecodeError, msgspec.ValidationError) as e:  # (its checksum held: what was written was wrong)
            lost.append(_lost(reader, ref, f"its records do not decode ({e})"))
            continue
        kept = [r for r in raws if peek(r)[0] not in _OWN]
        if not kept:
            continue
        info = msgspec.structs.replace(ref.info)  # (the writer sets its offset and length)
        if len(kept) == len(raws):
            chunk = CopiedChunk(info, frame=reader.frame(ref))
        else:
            info.num_records = len(kept)
            chunk = CopiedChunk(info, body=chunk_body(kept))
        writer.write_chunk(chunk, requests)
    return lost


def _lost(reader: CaptureReader, ref: ChunkRef, reason: str) -> str:
    """The line that says a chunk was left out, and why."""
    return f"{reader.path.name}: {Damage.chunk_lost(ref.number, ref.offset, ref.info, reason).describe()}"


def _live(raws: list[msgspec.Raw]) -> int:
    """How many requests the chunk's keyframe holds. Raises msgspec errors for one that does not decode."""
    for r in raws:
        if peek(r)[0] == "keyframe":
            return len(_KEYFRAME.decode(r).requests)
    return 0
