"""Writer: .partial while open, durable chunks by size and by age, clear errors, stock-zstd readability."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time

import pytest

from replay.capture import CaptureReader, CaptureWriter, Step
from replay.capture.format import records as fmt
from replay.capture.writing.filemode import MODE_ENV
from replay.contracts import SchedulerOutput
from replay.errors import CaptureError, UsageError
from replay.provenance import make_header


def test_partial_while_open_renamed_on_close(tmp_path):
    path = tmp_path / "run.capture"
    w = CaptureWriter(path, make_header("test"))
    assert w.partial_path.exists() and not path.exists()
    w.write_step(0, SchedulerOutput.make_empty(), None)
    assert w.close() == path
    assert path.exists() and not w.partial_path.exists()


def test_existing_capture_is_not_overwritten_by_default(small_capture):
    with pytest.raises(UsageError, match="already exists"):
        CaptureWriter(small_capture, make_header("test"))
    CaptureWriter(small_capture, make_header("test"), overwrite=True).close()


def test_steps_must_increase(tmp_path):
    with CaptureWriter(tmp_path / "x.capture", make_header("test")) as w:
        w.write_step(3, SchedulerOutput.make_empty(), None)
        with pytest.raises(UsageError, match="steps must increase"):
            w.write_step(3, SchedulerOutput.make_empty(), None)


def test_idle_engine_chunk_is_flushed_by_age(tmp_path):
    path = tmp_path / "idle.capture"
    w = CaptureWriter(path, make_header("test"), flush_interval=0.2)
    w.write_step(0, SchedulerOutput.make_empty(), None)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the background thread seals the chunk without another write
        time.sleep(0.1)
        with CaptureReader(w.partial_path) as r:
            if any(isinstance(x, Step) for x in r.records()):
                break
    else:
        pytest.fail("an idle chunk was never flushed")
    w.abandon()


def test_unencodable_value_is_one_clear_error(tmp_path):
    from replay.contracts import CachedRequestData, NewRequestData, SamplingParams

    sp = SamplingParams(extra_args={"x": 2**70})
    new = NewRequestData("r", [1], [], sp, None, ([0],), 0, None)
    so = SchedulerOutput([new], CachedRequestData.make_empty(), {"r": 1}, 1, {}, {}, set(), [])
    with CaptureWriter(tmp_path / "x.capture", make_header("test")) as w:
        with pytest.raises(UsageError, match="cannot record a Step"):
            w.write_step(0, so, None)


_FILL_THE_DISK = r"""
import resource, signal, sys
from replay.record.synth import SynthShape, record_synth
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)            # get EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
try:
    record_synth(sys.argv[1], SynthShape(steps=400, running=32, seed=1), chunk_bytes=8_000)
except Exception as e:
    print(type(e).__name__, e)
"""


def test_write_failure_is_one_clear_error_and_flushed_chunks_stay_readable(tmp_path):
    # A real OS write error (EFBIG from a file-size limit, the same path as ENOSPC) in a child process.
    path = tmp_path / "full.capture"
    out = subprocess.run([sys.executable, "-c", _FILL_THE_DISK, str(path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("CaptureError"), out.stdout + out.stderr
    assert "writing failed: File too large" in out.stdout
    partial = tmp_path / "full.capture.partial"
    with CaptureReader(partial) as r:
        steps = [x.index for x in r.records() if isinstance(x, Step)]
    assert steps == list(range(len(steps))) and len(steps) >= 5


@pytest.mark.skipif(shutil.which("zstd") is None, reason="stock zstd CLI not installed")
def test_stock_zstd_decompresses_the_whole_file_to_msgpack_records(small_capture):
    import msgpack  # an independent msgpack implementation: the stream is readable without replay

    out = subprocess.run(["zstd", "-dc", str(small_capture)], capture_output=True, check=True).stdout
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(out)
    records = [rec for chunk in unpacker for rec in chunk]  # one msgpack array of records per chunk
    tags = [r[0] for r in records]
    assert tags[0] == "header" and tags[-1] == "footer"
    assert sum(map(tags.count, ("step", "packed_step", "aligned_step"))) == 40


def test_close_reports_a_vanished_directory(tmp_path):
    d = tmp_path / "gone"
    w = CaptureWriter(d / "x.capture", make_header("test"))
    shutil.rmtree(d)
    with pytest.raises(CaptureError):
        w.close()


@pytest.mark.parametrize("odd", [1.0, True, "7"])
def test_a_prompt_that_is_not_all_ints_is_refused_at_its_arrival(tmp_path, odd):
    """Stored as it is, the reader's list[int] would refuse the record, and the arrival be lost: refused instead."""
    from msgspec.structs import replace

    from replay.record.synth import SynthShape, synth_events

    ev = next(e for e in synth_events(SynthShape(steps=4, running=2, num_logprobs=None, seed=1)) if e.request)
    bad = replace(ev.request, prompt_token_ids=[5, odd, 6])
    path = tmp_path / "x.capture"
    with CaptureWriter(path, make_header("test")) as w:
        with pytest.raises(UsageError, match="prompt_token_ids are not all ints"):
            w.add_request(bad, 0)
        w.add_request(ev.request, 0)  # the writer goes on
    with CaptureReader(path) as r:
        assert [x.request.request_id for x in r.records() if isinstance(x, fmt.RequestAdded)] == [ev.request.request_id]
        assert not r.damage


def test_a_new_capture_is_private_to_its_owner_unless_a_mode_is_chosen(tmp_path, monkeypatch):
    """A server's capture holds every user's prompt: created 0600 (as core dumps are) whatever the umask or a file
    that was there before; REPLAY_CAPTURE_MODE chooses another mode, and a mode the owner cannot write is refused."""
    old = os.umask(0o022)
    try:
        path = tmp_path / "private.capture"
        path.with_name(path.name + ".partial").write_bytes(b"")
        os.chmod(path.with_name(path.name + ".partial"), 0o666)
        with CaptureWriter(path, make_header("test")):
            pass
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        monkeypatch.setenv(MODE_ENV, "0640")
        with CaptureWriter(tmp_path / "shared.capture", make_header("test")):
            pass
        assert stat.S_IMODE((tmp_path / "shared.capture").stat().st_mode) == 0o640
        monkeypatch.setenv(MODE_ENV, "0444")
        with pytest.raises(UsageError, match="REPLAY_CAPTURE_MODE"):
            CaptureWriter(tmp_path / "bad.capture", make_header("test"))
    finally:
        os.umask(old)


def test_the_writer_keeps_only_the_live_requests_ids_and_every_chunk_reads_on_its_own(tmp_path):
    """A server records for a week: the writer's id table must follow the requests in flight, not every request
    since the start (format 1.5: a finished request's id is dropped, each chunk re-declares the live ones), and a
    step looked up through the index still resolves every request it names from its own chunk."""
    from replay.record.synth import SynthShape, synth_events

    shape = SynthShape(steps=400, running=6, prompt_len=(4, 12), output_len=(2, 6), num_logprobs=2, seed=11)
    path, steps, most = tmp_path / "long.capture", {}, 0
    with CaptureWriter(path, make_header("test"), chunk_bytes=3000) as w:
        for ev in synth_events(shape):
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
            else:
                w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
                steps[ev.step] = ev
                most = max(most, len(w._ids.interning))
        handles = w._ids.count
    assert handles > 10 * most and most <= 2 * shape.running  # hundreds of requests, a dozen ids held at most
    with CaptureReader(path) as r:
        assert r.index.ids == [] and r.index.num_requests == handles and len(r.index.chunks) > 20
        for k in (7, 199, 333, 399):  # one chunk each: what that chunk declares is all it needs
            got, want = r.step(k), steps[k]
            assert got.scheduler_output == want.scheduler_output and got.model_runner_output == want.model_runner_output
        assert not r.damage


def test_a_step_refused_at_a_chunks_start_leaves_its_declarations_to_the_next(tmp_path):
    """A step the writer refuses (a value msgpack cannot hold) must not take the chunk's declarations with it: the
    steps after it name the same requests, and every chunk reads on its own."""
    from replay.record.synth import SynthShape, synth_events

    events = list(synth_events(SynthShape(steps=60, running=8, num_logprobs=None, seed=1)))
    path, kept = tmp_path / "x.capture", []
    with CaptureWriter(path, make_header("test"), keyframes=0) as w:
        for ev in events:
            if ev.request is not None:
                w.add_request(ev.request, ev.step)
            elif ev.step == 30:  # the first step of a chunk (the flush below), refused
                w.flush()
                rid = next(iter(ev.scheduler_output.num_scheduled_tokens))
                with pytest.raises(UsageError, match="cannot record a Step"):
                    w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output, drawn_seeds={rid: 2**70})
            else:
                w.write_step(ev.step, ev.scheduler_output, ev.model_runner_output)
                kept.append(ev)
    with CaptureReader(path) as r:
        got = list(r.steps())
        assert not r.damage
    assert [s.scheduler_output for s in got] == [ev.scheduler_output for ev in kept]
