"""Replaying what is there: an unfinished or damaged capture replays its longest readable prefix without
`replay recover`, says where and why it stops, and exits with the comparison's result (3 when the prefix matched
but data was lost)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from replay.capture import CaptureReader, CaptureWriter, RequestAdded, Step
from replay.cli import app
from replay.replayer import check_capture, replay_capture

GOLDEN = Path(__file__).resolve().parents[2] / "captures" / "tiny-mixed.capture"
cli = CliRunner()


def _chunked(tmp_path: Path) -> Path:
    """The golden capture written again in small chunks (about 3 steps each)."""
    path = tmp_path / "chunked.capture"
    with CaptureReader(GOLDEN) as r, CaptureWriter(path, r.header, chunk_bytes=1500) as w:
        for rec in r.records():
            if isinstance(rec, Step):
                w.write_step_record(rec)
            elif isinstance(rec, RequestAdded):
                w.add_request(rec.request, rec.step)
    return path


def _damaged(tmp_path: Path) -> Path:
    """The chunked golden capture with one byte flipped in the middle of a chunk past its first third."""
    path = _chunked(tmp_path)
    with CaptureReader(path) as r:
        chunks = [c for c in r.index.chunks if c.num_steps]
        chunk = chunks[len(chunks) // 3]
    data = bytearray(path.read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def _unfinished(tmp_path: Path) -> Path:
    """The chunked golden capture cut inside its middle chunk, as a killed writer leaves it (no index)."""
    full = _chunked(tmp_path)
    path = tmp_path / "cut.capture.partial"
    with CaptureReader(full) as r:
        chunk = r.index.chunks[len(r.index.chunks) // 2]
    path.write_bytes(full.read_bytes()[:chunk.offset + chunk.length // 2])
    return path


def test_a_damaged_capture_replays_its_readable_prefix(tmp_path):
    path = _damaged(tmp_path)
    rep = replay_capture(path)
    assert not rep.diverged and rep.data_lost and rep.steps_replayed > 0
    assert rep.stopped is not None and rep.stopped.startswith("steps ") and "missing" in rep.stopped
    res = cli.invoke(app, ["run", str(path), "--diff"])
    assert res.exit_code == 3 and "capture damaged" in res.stdout and "MATCH" in res.stdout


def test_an_unfinished_capture_replays_without_recover(tmp_path):
    path = _unfinished(tmp_path)
    rep = replay_capture(path)
    assert not rep.diverged and rep.data_lost and 0 < rep.steps_replayed < 37
    res = cli.invoke(app, ["run", str(path), "--diff"])
    assert res.exit_code == 3 and f"replayed {rep.steps_replayed} steps" in res.stdout
    assert cli.invoke(app, ["run", str(path), "--diff", "--set", "dtype=bfloat16"]).exit_code == 1  # it diverges


def test_check_of_a_damaged_capture_answers_for_the_prefix_and_says_so(tmp_path):
    res = check_capture(_damaged(tmp_path))
    assert res.code == 0 and "data was lost" in res.reason


def test_bisect_steps_on_a_damaged_capture(tmp_path):
    res = cli.invoke(app, ["bisect", "steps", str(_damaged(tmp_path))])
    assert res.exit_code == 3 and "no step" in res.stdout
