"""Looking into a stored record without decoding it: its tag and first field (the step index) from its first
bytes, so random access decodes one record; and whether an undecodable record is simply a newer kind."""

from __future__ import annotations

import msgspec

from replay.capture.format import records as fmt


def is_unknown_tag(raw: msgspec.Raw) -> bool:
    """True when a record is a well-formed array whose tag this version does not know (a newer minor format)."""
    try:
        value = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return False
    return isinstance(value, list) and bool(value) and isinstance(value[0], str) and value[0] not in fmt.RECORD_TAGS


def peek(raw: bytes) -> tuple[str | None, int | None]:
    """(tag, first field as int) of a stored record, read from its first bytes without decoding it; (None, None)
    when the bytes do not look as expected (the caller then decodes the record in full)."""
    b = memoryview(raw)
    try:
        h = b[0]
        p = 1 if 0x90 <= h <= 0x9F else 3 if h == 0xDC else 5 if h == 0xDD else 0
        if not p:
            return None, None
        h = b[p]
        if not 0xA0 <= h <= 0xBF:
            return None, None
        n = h & 0x1F
        tag = bytes(b[p + 1:p + 1 + n]).decode("ascii")
        p += 1 + n
        h = b[p]
        if h <= 0x7F:
            return tag, h
        width = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}.get(h)
        if width is None:
            return tag, None
        return tag, int.from_bytes(b[p + 1:p + 1 + width], "big")
    except (IndexError, UnicodeDecodeError):
        return None, None
