"""FrameReader: frames come back whole and in order however the pipe cuts them, large ones included."""

from __future__ import annotations

import os
import random
import struct
import threading

from replay.capture.writing.frame_protocol import FrameReader


def _frames(sizes):
    rng = random.Random(3)
    return [(bytes([65 + i % 26]), rng.randbytes(n)) for i, n in enumerate(sizes)]


def _pipe_in_pieces(data: bytes, cut_at_end: int = 0):
    r, w = os.pipe()

    def feed():
        rng, at = random.Random(5), 0
        end = len(data) - cut_at_end
        while at < end:
            n = min(rng.choice([1, 3, 700, 70_000, 3_000_000]), end - at)
            os.write(w, data[at:at + n])  # (blocks while the pipe is full)
            at += n
        os.close(w)

    threading.Thread(target=feed, daemon=True).start()
    return r


def test_frames_read_back_whole_however_the_pipe_cuts_them():
    frames = _frames([0, 1, 5, 4000, 70_000, 5_000_000, 12, 2_500_000, 0, 9])
    data = b"".join(struct.pack("<cI", k, len(p)) + p for k, p in frames)
    reader = FrameReader(_pipe_in_pieces(data), gulp_s=0)
    got = [reader.next() for _ in frames]
    assert [(k, bytes(p)) for k, p in got] == frames
    assert reader.next() == (None, b"")  # the end of the pipe, between frames


def test_a_pipe_that_ends_inside_a_frame_says_so():
    for big in (False, True):
        frames = _frames([10, 3_000_000 if big else 300])
        data = b"".join(struct.pack("<cI", k, len(p)) + p for k, p in frames)
        reader = FrameReader(_pipe_in_pieces(data, cut_at_end=7), gulp_s=0)
        assert bytes(reader.next()[1]) == frames[0][1]
        assert reader.next() == (None, None)
