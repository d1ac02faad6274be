"""A ring's sizes and names."""

from __future__ import annotations

import pytest

from replay.capture.flight.directory import (
    KEEP_ENV,
    RingDirectory,
    keep_snapshots,
    parse_size,
)
from replay.errors import UsageError


@pytest.mark.parametrize("text,n", [("4MB", 4 << 20), ("4 MiB", 4 << 20), ("512kb", 512 << 10), ("1g", 1 << 30),
                                    ("262144", 262144), ("0.5MB", 1 << 19)])
def test_sizes_read_in_binary_units(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "lots", "4 parsecs", "-4MB", "1KB"])
def test_what_is_no_size_or_too_small_a_ring_is_refused_by_name(text):
    with pytest.raises(UsageError, match="REPLAY_CAPTURE_RING"):
        parse_size(text)


def test_segments_list_oldest_first_and_snapshot_names_never_collide(tmp_path):
    ring = RingDirectory(tmp_path / "ring")
    ring.create()
    for seq in (12, 3, 100):
        ring.segment(seq).write_bytes(b"x")
    (ring.dir / "segment-000101.capture.partial").write_bytes(b"x")
    assert [p.name for p in ring.segments()] == ["segment-000003.capture", "segment-000012.capture",
                                                 "segment-000100.capture"]
    a = ring.snapshot("Crash at step 7")
    a.write_bytes(b"x")
    b = ring.snapshot("Crash at step 7")
    assert a != b and a.name.endswith("-crash-at-step-7.capture")
    assert ring.control_address() == RingDirectory(ring.dir / ".." / "ring").control_address()
    ring.create()  # a new recording: the old segments go, the snapshots stay
    assert ring.segments() == [] and a.exists()


def test_how_many_snapshots_are_kept(monkeypatch):
    assert keep_snapshots() == 8
    monkeypatch.setenv(KEEP_ENV, "3")
    assert keep_snapshots() == 3
    monkeypatch.setenv(KEEP_ENV, "none")
    with pytest.raises(UsageError, match=KEEP_ENV):
        keep_snapshots()
