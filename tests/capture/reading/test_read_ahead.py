"""Chunks decompressed ahead on worker threads: the same records, the same damage, in the same order, as reading
every chunk on the caller's thread; bounded memory; no thread left behind."""

from __future__ import annotations

import struct
import threading

import msgspec
import pytest

from replay.capture import CaptureReader
from replay.capture.reading.read_ahead import MIN_AHEAD, ReadAhead
from replay.errors import CaptureDamagedError


def everything(path, read_ahead):
    """Every record (encoded, to compare bit for bit), every damage entry, every chunk's bytes or error."""
    with CaptureReader(path, read_ahead=read_ahead) as r:
        records = [msgspec.msgpack.encode(rec) for rec in r.records()]
        damage = list(r.damage)
        chunks = [(ref.number, data, None if e is None else (type(e), e.reason)) for ref, data, e in r.chunk_bytes()]
    return records, damage, chunks


def reader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("replay-capture-read")]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_read_ahead_reads_what_the_caller_thread_reads(small_capture, workers):
    alone = everything(small_capture, 0)
    assert everything(small_capture, workers) == alone
    assert len(alone[2]) > 5 and alone[1] == []  # many chunks, none damaged
    assert reader_threads() == []  # close() stopped the workers


def corrupt_chunk(path, k):
    """Flip a byte in the middle of data chunk `k`; returns the chunk's number."""
    with CaptureReader(path) as r:
        c = r.index.chunks[k]
    data = bytearray(path.read_bytes())
    data[c.offset + c.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return k


def test_a_damaged_chunk_is_reported_in_its_place(small_capture):
    k = corrupt_chunk(small_capture, 3)
    alone = everything(small_capture, 0)
    ahead = everything(small_capture, 2)
    assert ahead == alone
    records, damage, chunks = ahead
    assert [d.chunk for d in damage] == [k]
    assert [n for n, _, e in chunks if e is not None] == [k]
    assert chunks[k][2][0] is CaptureDamagedError


def test_without_the_index_the_linear_scan_reads_the_same(small_capture, tmp_path):
    data = small_capture.read_bytes()
    index_at = struct.unpack_from("<Q", data, len(data) - 16)[0]
    p = tmp_path / "noindex.capture"
    p.write_bytes(data[:index_at - 7])  # no index, and the last chunk cut short
    alone = everything(p, 0)
    assert everything(p, 2) == alone
    assert [d.kind for d in alone[1]] == ["truncated", "unfinished"]


def test_a_reader_stopped_early_closes_cleanly(small_capture):
    with CaptureReader(small_capture, read_ahead=2) as r:
        first = next(iter(r.records()))
        assert type(first).__name__ == "Header"
        assert r.step(20).index == 20  # the abandoned walk leaves the reader usable
    assert reader_threads() == []


def test_results_come_in_order_and_at_most_ahead_items_are_drawn():
    drawn: list[int] = []

    def source():
        for i in range(50):
            drawn.append(i)
            yield i

    ahead = ReadAhead(2)
    threads = {}

    def square(i):
        threads[i] = threading.current_thread().name
        return i * i

    try:
        out = []
        for item, result, error in ahead.map(square, source(), (ValueError,)):
            # never more than `ahead` beyond what was yielded, once past the first few (drawn together)
            assert len(drawn) <= max(MIN_AHEAD, item + 1 + ahead.ahead)
            out.append((item, result, error))
        assert out == [(i, i * i, None) for i in range(50)]
        assert all(threads[i].startswith("replay-capture-read") for i in range(50))
    finally:
        ahead.close()


@pytest.mark.parametrize("n", range(MIN_AHEAD))
def test_a_short_walk_starts_no_thread(n):
    ahead = ReadAhead(2)
    try:
        out = [(item, result) for item, result, _ in ahead.map(lambda i: (i, threading.current_thread().name),
                                                                range(n), ())]
        assert out == [(i, (i, threading.current_thread().name)) for i in range(n)]
        assert reader_threads() == []
    finally:
        ahead.close()


def test_caught_errors_come_with_their_item_and_others_propagate():
    def f(i):
        if i == 3:
            raise ValueError("three")
        if i == 7:
            raise KeyError("seven")
        return i

    for workers in (0, 2):
        ahead = ReadAhead(workers)
        try:
            seen = []
            with pytest.raises(KeyError, match="seven"):
                for item, result, error in ahead.map(f, range(10), (ValueError,)):
                    seen.append((item, result, None if error is None else str(error)))
            assert seen == [(0, 0, None), (1, 1, None), (2, 2, None), (3, None, "three"), (4, 4, None),
                            (5, 5, None), (6, 6, None)]
        finally:
            ahead.close()


def test_without_the_index_damage_is_reported_in_the_order_the_scan_meets_it(small_capture, tmp_path):
    with CaptureReader(small_capture) as r:
        chunks = r.index.chunks
    data = bytearray(small_capture.read_bytes())
    index_at = struct.unpack_from("<Q", data, len(data) - 16)[0]
    data[chunks[2].offset + chunks[2].length // 2] ^= 0xFF  # a checksum failure, found when chunk 2 is read
    data[chunks[5].offset:chunks[5].offset + 4] = b"JUNK"  # garbage, found by the scan itself
    p = tmp_path / "noindex.capture"
    p.write_bytes(bytes(data[:index_at]))
    alone = everything(p, 0)
    assert everything(p, 2) == alone
    kinds = [d.kind for d in alone[1]]
    assert "chunk" in kinds and "garbage" in kinds and kinds.index("chunk") < kinds.index("garbage")
