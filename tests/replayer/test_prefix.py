"""Replaying what is there: an unfinished or damaged capture replays its longest readable prefix without
`replay recover`, says where and why it stops, and exits with the comparison's result (3 when the prefix matched
but data was lost)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from typer.testing import CliRunner

from replay.capture import CaptureReader, CaptureWriter
from replay.cli import app
from replay.replayer import check_capture, replay_capture

CAPTURES = Path(__file__).resolve().parents[2] / "captures"
spec = importlib.util.spec_from_file_location("regenerate", CAPTURES / "regenerate.py")
regenerate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(regenerate)
cli = CliRunner()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """The golden workload recorded here (the committed golden may come from another processor: these tests are
    about the prefix, so the replay must be bitwise on this machine)."""
    return regenerate.record_golden("tiny-mixed", tmp_path_factory.mktemp("prefix"))


def _chunked(tmp_path: Path, source: Path) -> Path:
    """The golden workload's capture written again in small chunks (about 3 steps each)."""
    path = tmp_path / "chunked.capture"
    with CaptureReader(source) as r, CaptureWriter(path, r.header, chunk_bytes=1500) as w:
        for rec in r.records():
            w.write_record(rec)
    return path


def _damaged(tmp_path: Path, source: Path) -> Path:
    """The chunked golden capture with one byte flipped in the middle of a chunk past its first third."""
    path = _chunked(tmp_path, source)
    with CaptureReader(path) as r:
        chunks = [c for c in r.index.chunks if c.num_steps]
        chunk = chunks[len(chunks) // 3]
    data = bytearray(path.read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def _unfinished(tmp_path: Path, source: Path) -> Path:
    """The chunked golden capture cut inside its middle chunk, as a killed writer leaves it (no index)."""
    full = _chunked(tmp_path, source)
    path = tmp_path / "cut.capture.partial"
    with CaptureReader(full) as r:
        chunk = r.index.chunks[len(r.index.chunks) // 2]
    path.write_bytes(full.read_bytes()[:chunk.offset + chunk.length // 2])
    return path


def test_a_damaged_capture_replays_its_readable_prefix(tmp_path, recorded):
    path = _damaged(tmp_path, recorded)
    rep = replay_capture(path)
    assert not rep.diverged and rep.data_lost and rep.steps_replayed > 0
    assert rep.stopped is not None and rep.stopped.startswith("steps ") and "missing" in rep.stopped
    res = cli.invoke(app, ["run", str(path), "--diff"])
    assert res.exit_code == 3 and "capture damaged" in res.stdout and "MATCH" in res.stdout


def test_an_unfinished_capture_replays_without_recover(tmp_path, recorded):
    path = _unfinished(tmp_path, recorded)
    rep = replay_capture(path)
    assert not rep.diverged and rep.data_lost and 0 < rep.steps_replayed < 37
    res = cli.invoke(app, ["run", str(path), "--diff"])
    assert res.exit_code == 3 and f"replayed {rep.steps_replayed} steps" in res.stdout
    assert cli.invoke(app, ["run", str(path), "--diff", "--set", "dtype=bfloat16"]).exit_code == 1  # it diverges


def test_check_of_a_damaged_capture_answers_for_the_prefix_and_says_so(tmp_path, recorded):
    res = check_capture(_damaged(tmp_path, recorded))
    assert res.code == 0 and "data was lost" in res.reason


def test_bisect_steps_on_a_damaged_capture(tmp_path, recorded):
    res = cli.invoke(app, ["bisect", "steps", str(_damaged(tmp_path, recorded))])
    assert res.exit_code == 3 and "no step" in res.stdout
