"""`stress` on a capture: a recorded request replayed with random subsets of its real neighbours left out, from the
keyframe nearest it, on a ring's snapshot and on a single segment (builtin runner; vLLM's runner on a server's
wrapped ring in tests/integrations/vllm/test_server.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from replay.bisect.stress_capture import stress_capture
from replay.capture import CaptureReader, Keyframe, RequestAdded, Step
from replay.capture.flight.control import request_snapshot
from replay.cli import app
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.errors import UsageError
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=96, max_num_seqs=8,
                                                 max_num_batched_tokens=64), runner=RunnerConfig(num_threads=1))
    # arrivals until the end: the ring keeps the last steps, and under load its segments hold fewer of them
    wl = synthetic(SyntheticWorkload(num_requests=200, arrival_rate=0.5, output_len=(8, 24)), 512)
    path = tmp_path_factory.mktemp("ring") / "ring"
    record_builtin(RecordOptions(cfg, wl, path, ring=96 << 10, flush_interval=0.05))
    return path


def _segment(ring):
    """A segment in which a request arrives and is first scheduled after its keyframe, the newest but one first
    (how many steps a segment holds follows the writer's flushes, which follow the machine's load: the newest may
    hold only the workload's tail, where nothing starts)."""
    segments = sorted(ring.glob("segment-*.capture"))
    for path in [*segments[-2::-1], segments[-1]]:
        try:
            _crowded(path)
            return path
        except IndexError:  # (none starts there)
            continue
    raise AssertionError(f"no segment of {ring} has a request that arrives and starts after its keyframe")


def _crowded(path, rank: int = 0) -> tuple[int, str, list[int]]:
    """(the keyframe before it, a request first scheduled after a keyframe with the most neighbours (`rank`: the
    next most), its recorded tokens)."""
    with CaptureReader(path) as r:
        keyframe, names, tokens, seen = None, {}, {}, {}
        for rec in r.records():
            if isinstance(rec, Keyframe):
                keyframe = rec.step
            elif isinstance(rec, RequestAdded):
                names[rec.request.request_id] = rec.request.name
            elif isinstance(rec, Step) and keyframe is not None:
                for n in rec.scheduler_output.scheduled_new_reqs:
                    seen[n.req_id] = (keyframe, set())
                for q in rec.scheduler_output.num_scheduled_tokens:
                    if q in seen:
                        seen[q][1].update(rec.scheduler_output.num_scheduled_tokens)
                out = rec.model_runner_output
                for q, toks in zip(out.req_ids, out.sampled_token_ids) if out is not None else ():
                    tokens.setdefault(q, []).extend(toks)
        k, q = sorted(((len(s), k, q) for q, (k, s) in seen.items() if q in names), reverse=True)[rank][1:]
    return k, names[q], tokens[q]


@pytest.mark.parametrize("which", ["snapshot", "segment"])
def test_stress_on_a_rings_snapshot_and_segment_varies_the_real_neighbours_from_the_nearest_keyframe(ring, which):
    capture = request_snapshot(ring).path if which == "snapshot" else _segment(ring)
    k, request, recorded = _crowded(capture)
    res = stress_capture(capture, request, trials=5, seed=2)
    assert res.trials == 5 and res.request == request and res.left_out[0] == 0 and all(res.left_out[1:])
    assert any(f"replayed from the keyframe at step {k}" in n for n in res.notes), res.notes
    assert "trial 0 (every neighbour, as recorded) samples the recorded completion" in res.notes
    # float32 on CPU: another batch, other bits (batch variance); the fork names the batches where it happened.
    # (Which requests a ring keeps depends on timing, and a processor's GEMM can give one request the same bits at
    # every batch size it met: the next most crowded then shows it.)
    for rank in (1, 2):
        if res.unique_logprob_sequences > 1:
            break
        try:
            k, request, _ = _crowded(capture, rank)
        except IndexError:  # (no other request starts there)
            break
        res = stress_capture(capture, request, trials=5, seed=2)
    assert res.unique_logprob_sequences > 1 and res.first_fork is not None, res.verdict
    invariant = stress_capture(capture, request, trials=5, seed=2, overrides={"batch_invariant": "true"})
    assert invariant.unique_logprob_sequences == 1 and invariant.unique_completions == 1, invariant.verdict
    assert invariant.batch_invariant and "promises bitwise repeats" in invariant.notes[-1]


def test_stress_on_a_capture_from_the_command_line(ring):
    capture = _segment(ring)
    _, request, _ = _crowded(capture)
    out = CliRunner().invoke(app, ["stress", str(capture), "--request", request, "--trials", "3", "-q"])
    assert out.exit_code == 0, out.output
    assert out.output.startswith(f"3 replays of request {request} (steps ") and "unique logprob sequence" in out.output
    for args, said in [(["--request", "nobody"], "no request 'nobody'"),
                       (["--request", request, "--prompt", "hi"], "on a capture, stress takes --request"),
                       (["--request", request, "--jobs", "2"], "--jobs and --ray are for a prompt")]:
        bad = CliRunner().invoke(app, ["stress", str(capture), *args])
        assert bad.exit_code == 2 and said in bad.output, bad.output
    with pytest.raises(UsageError, match="--trials must be at least 2"):
        stress_capture(capture, request, trials=1)


def test_stress_on_a_capture_cut_short_says_what_it_lost_and_exits_3(ring, tmp_path):
    capture = _segment(ring)
    cut = tmp_path / "cut.capture"
    data = capture.read_bytes()
    cut.write_bytes(data[: len(data) * 3 // 4])  # the writer's host died: no index, a torn last chunk
    _, request, _ = _crowded(cut)
    out = CliRunner().invoke(app, ["stress", str(cut), "--request", request, "--trials", "2", "-q"])
    assert out.exit_code == 3 and "capture damaged (" in out.output, out.output
    assert "the request's steps end where its readable prefix does" in out.output
