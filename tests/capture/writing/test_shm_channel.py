"""The shared-memory channel between the engine thread and the writer process: frames arrive whole and in order
across wraps, pieces and a full buffer; an engine gone inside a frame is said to be; a writer gone or failed stops the
engine's sends. Both sides run here in one process (a thread reads), over a real memfd and a real pipe."""

from __future__ import annotations

import os
import random
import threading

import pytest

from replay.capture.writing import shm_channel

pytestmark = pytest.mark.skipif(not shm_channel.available(),
                                reason="the channel needs Linux on x86-64 (elsewhere: the pipe)")


def _pair(size: int = 4096):
    read_end, write_end = os.pipe()
    sender = shm_channel.ChannelSender(write_end, size)
    reader = shm_channel.ChannelReader(os.dup(sender.fd), size, read_end, gulp_s=0.001, idle_s=0.01)
    sender.populate()
    return sender, reader, read_end, write_end


def _drain(reader) -> tuple[list, object]:
    got = []
    while True:
        kind, payload = reader.next()
        if kind is None:
            return got, payload
        got.append((kind, bytes(payload)))


def test_frames_arrive_whole_and_in_order_across_wraps_pieces_and_a_full_buffer():
    sender, reader, read_end, write_end = _pair(4096)
    rnd = random.Random(5)
    # 0 bytes up to three buffers' worth: some fit, some wrap the tail, some go in pieces; the buffer is full often
    sizes = [rnd.choice([0, 1, 3, 7, 8, 100, 1000, 1023, 1500, 5000, 12_000]) for _ in range(400)]
    frames = [(bytes([65 + i % 26]), os.urandom(n)) for i, n in enumerate(sizes)]
    result = {}
    t = threading.Thread(target=lambda: result.update(zip(("got", "end"), _drain(reader))))
    t.start()
    for kind, payload in frames:
        half = len(payload) // 2
        sender.send(kind, (payload[:half], payload[half:]), len(payload))
    os.close(write_end)  # the engine is done: the reader sees the end of the pipe
    t.join(30)
    assert result["got"] == frames and result["end"] == b""
    assert sender.waits > 0  # the buffer filled and the sender waited for room, rather than overwrite
    os.close(read_end)


def test_an_engine_gone_inside_a_frame_is_said_to_be():
    sender, reader, read_end, write_end = _pair(4096)
    sender.send(b"S", (b"whole",), 5)
    # what a sender killed between reserving a frame and publishing it leaves
    sender.reserved.value = sender.w + 64
    sender.mm[shm_channel.CONTROL + 16:shm_channel.CONTROL + 48] = b"\xff" * 32  # (the first frame: 16 bytes)
    os.close(write_end)
    assert _drain(reader) == ([(b"S", b"whole")], None)
    os.close(read_end)


def test_an_engine_gone_between_the_pieces_of_a_frame_is_said_to_be():
    sender, reader, read_end, write_end = _pair(4096)
    big = os.urandom(3000)  # more than a quarter of the buffer: pieces of 512 bytes
    frame = shm_channel.HEAD.pack(b"S", len(big)) + big
    for i in range(0, 1536, 512):  # the first three pieces, then the engine dies
        sender.send(b"\1", (frame[i:i + 512],), 512)  # (kind 1: a piece)
    os.close(write_end)
    assert _drain(reader) == ([], None)
    os.close(read_end)


def test_a_writer_that_failed_stops_the_next_send():
    sender, reader, read_end, write_end = _pair()
    sender.send(b"S", (b"x",), 1)
    reader.fail()  # what the writer process does before it says its error on stdout
    with pytest.raises(shm_channel.WriterGone, match="stopped"):
        sender.send(b"S", (b"y",), 1)
    os.close(read_end)
    os.close(write_end)


def test_a_writer_gone_stops_the_sends_within_a_liveness_period():
    sender, reader, read_end, write_end = _pair(1 << 16)
    reader.release()
    os.close(read_end)  # a SIGKILLed writer process: nobody reads the pipe
    with pytest.raises(shm_channel.WriterGone, match="gone"):
        for i in range(shm_channel.ChannelSender.LIVENESS_EVERY + 1):
            sender.consumed.value = sender.w  # (room is never what stops it)
            sender.send(b"S", (b"z" * 10,), 10)
    assert i < shm_channel.ChannelSender.LIVENESS_EVERY
    os.close(write_end)


def test_a_buffer_size_that_is_no_power_of_two_is_refused():
    read_end, write_end = os.pipe()
    with pytest.raises(ValueError, match="power of two"):
        shm_channel.ChannelSender(write_end, 5000)
    os.close(read_end)
    os.close(write_end)


def test_a_pipe_full_of_unread_wake_ups_does_not_block_the_sender():
    """A writer busy for long, its buffer never empty, never reads the pipe: the wake-ups it has not read must not
    fill the pipe and block the engine."""
    sender, reader, read_end, write_end = _pair()
    for _ in range(100_000):  # far more than a pipe holds (64 KiB by default)
        sender.wake()
    sender.send(b"S", (b"still",), 5)
    assert reader.next() == (b"S", b"still")
    os.close(read_end)
    os.close(write_end)
