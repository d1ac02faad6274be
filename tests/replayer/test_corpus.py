"""`replay check CORPUS`: 40 real builtin captures (several workloads), two recorded under a planted change of a
numerics setting (MKL's conditional numerical reproducibility, `MKL_CBWR=COMPATIBLE`, which changes float32 GEMM
results on this CPU), and one damaged; checked serially, in two local processes and as Ray tasks on a local
single-node cluster (Ray itself, not a stand-in: `pip install ray` is part of the test extras)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replay.cli import main
from replay.processes.fanout import FanOut
from replay.record import EngineOptions, SyntheticWorkload, record, synthetic
from replay.replayer.corpus import check_corpus, corpus_paths

PLANTED = ("planted-0.capture", "planted-1.capture")
PLANT = "MKL_CBWR: recorded COMPATIBLE, replay -"
DAMAGED = "damaged.capture"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    shapes = [dict(sampling="greedy"), dict(sampling="mixed"), dict(sampling="greedy", num_logprobs=None),
              dict(sampling="mixed", shared_prefix_fraction=0.8)]
    for i in range(37):
        wl = SyntheticWorkload(num_requests=3 + i % 4, prompt_len=(4, 12 + i % 5), output_len=(2, 6), seed=i,
                               **shapes[i % len(shapes)])
        record(EngineOptions(model="tiny", threads=1), synthetic(wl, 512), d / f"w{i:02d}.capture")
    # the candidate differs from these recordings in one setting; LD_PRELOAD is dropped because a vLLM engine built
    # earlier in this test process sets it in os.environ for the processes it starts (not in this one)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    for name in PLANTED:
        out = subprocess.run([sys.executable, "-m", "replay.cli", "record", "--threads", "1", "--num-requests", "4",
                              "--output-len", "2:6", "--out", str(d / name)], capture_output=True, text=True,
                             env=dict(env, MKL_CBWR="COMPATIBLE"), timeout=300)
        assert out.returncode == 0, out.stderr
    shutil.copy(d / "w00.capture", d / DAMAGED)
    with open(d / DAMAGED, "r+b") as f:  # a flipped byte in the middle of a chunk
        f.seek(os.path.getsize(d / DAMAGED) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert len(corpus_paths(d)) == 40
    return d


@pytest.fixture(scope="module")
def serial(corpus):
    return check_corpus(corpus)


def _verdicts(res) -> dict[str, tuple[str, str, bool]]:
    """Verdict, first divergence, and whether the planted setting is among the differences named. (Which difference
    leads can depend on where a replay runs: Ray workers start with the environment Ray was started with.)"""
    return {Path(r.capture).name: (r.verdict, r.first_divergence, PLANT in r.differences) for r in res.rows}


def test_a_corpus_check_names_the_planted_and_the_damaged_captures(serial):
    bad = sorted(Path(r.capture).name for r in serial.rows if r.verdict == "bad")
    cannot = [r for r in serial.rows if r.verdict == "cannot test"]
    assert bad == list(PLANTED) and serial.code == 1
    assert [Path(r.capture).name for r in cannot] == [DAMAGED] and "damaged" in cannot[0].reason.lower()
    assert serial.good == 37 and serial.bad == 2 and serial.cannot_test == 1
    planted = [r for r in serial.rows if Path(r.capture).name in PLANTED]
    assert all(r.suspect == PLANT for r in planted)
    group = serial.groups[0]  # the difference that explains the divergences comes first
    assert group.differences == [PLANT] and (group.captures, group.diverged) == (2, 2)
    # the damaged one was never compared: a group of its own, not "recorded like this runner"; its loss is counted
    assert cannot[0].data_lost and "chunk" in cannot[0].data_lost
    untested = serial.groups[-1]
    assert not untested.tested and (untested.captures, untested.cannot_test) == (1, 1)
    assert "not compared" in untested.label
    assert all(g.tested and not g.cannot_test for g in serial.groups[:-1])


def test_ray_tasks_and_local_processes_give_the_serial_rows(corpus, serial):
    pytest.importorskip("ray")
    on_ray = check_corpus(corpus, how=FanOut(ray=True))
    assert _verdicts(on_ray) == _verdicts(serial) and on_ray.code == serial.code
    assert on_ray.how == "Ray (a local single-node cluster)"
    in_processes = check_corpus(corpus, how=FanOut(jobs=2))
    assert _verdicts(in_processes) == _verdicts(serial)


def test_an_interrupted_run_resumes_from_its_results_file(corpus, serial, tmp_path):
    results = tmp_path / "results.jsonl"
    first = check_corpus(corpus, results=results)
    lines = results.read_bytes().splitlines()
    assert len(lines) == 40
    results.write_bytes(b"\n".join(lines[:25]) + b"\n" + lines[25][:20])  # killed while writing row 26
    seen = []
    again = check_corpus(corpus, results=results, on_row=seen.append)
    assert again.resumed == 25 and len(seen) == 15
    assert _verdicts(again) == _verdicts(first) == _verdicts(serial)
    (corpus / "w05.capture").touch()  # a changed capture is checked again
    assert check_corpus(corpus, results=results).resumed == 39


def _interruptible() -> None:
    """SIGINT as a terminal's foreground process gets it. A child inherits an ignored or blocked SIGINT, and once,
    under xdist beside other modules, the command ran through the signal to its end (exit 1, nothing on stderr)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_says_where_the_rows_are_and_that_the_same_command_resumes(corpus, tmp_path):
    """Interrupted with its output redirected (no row shown as it finished), the command says where the finished
    rows are, and running it again resumes from them."""
    results = tmp_path / "r.jsonl"
    cmd = [sys.executable, "-m", "replay.cli", "check", str(corpus), "--results", str(results)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not (results.exists() and results.read_bytes().count(b"\n") >= 2):
        assert time.monotonic() < deadline, "no row within 2 minutes"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (err, out[-2000:])  # (38 more replays take far longer than the signal)
    assert err.strip().splitlines()[-1] == f"replay: interrupted: the captures checked are in {results}; the same " \
                                           "command resumes from there", err
    assert check_corpus(corpus, results=results).resumed >= 2


def test_the_command_line_prints_a_row_each_and_a_summary_with_bisect_exit_codes(corpus, tmp_path, capsys):
    listing = tmp_path / "list.txt"
    listing.write_text(f"# two good captures\n{corpus / 'w01.capture'}\n\n{corpus / 'w02.capture'}\n")
    assert main(["check", str(listing)]) == 0
    out = capsys.readouterr().out
    assert out.count("GOOD") == 2 and "2 captures: 2 good, 0 bad, 0 cannot test (serial" in out
    assert main(["check", str(corpus / "planted-*.capture"), "--json"]) == 1
    res = json.loads(capsys.readouterr().out)
    assert [r["verdict"] for r in res["rows"]] == ["bad", "bad"] and res["code"] == 1
    listing.write_text(f"{corpus / DAMAGED}\n{corpus / 'nowhere.capture'}\n")
    assert main(["check", str(listing)]) == 125  # nothing could be tested: skip, not "bad commit"
    assert main(["check", str(tmp_path / "empty-*.capture")]) == 125
    # an unwritable results file: one line, and cannot test (a mistake is no bad commit)
    assert main(["check", str(corpus / "w01.capture"), "--results", str(tmp_path / "no-dir" / "r.jsonl")]) == 125
    assert "r.jsonl: cannot write it (No such file or directory)" in capsys.readouterr().err


def test_a_capture_cut_short_is_checked_on_its_readable_prefix_and_the_loss_is_said(tmp_path, capsys):
    """A recording whose file ends early (a host that died) is good or bad on what it holds, never silently so: its
    row and the summary say it lost data."""
    whole, cut = tmp_path / "whole.capture", tmp_path / "cut.capture"
    wl = SyntheticWorkload(num_requests=24, prompt_len=(4, 12), output_len=(20, 40), seed=3, sampling="greedy")
    record(EngineOptions(model="tiny", threads=1), synthetic(wl, 512), whole, flush_interval=0.001)  # many chunks
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size * 2 // 3])
    assert main(["check", str(tmp_path / "*.capture")]) == 0
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if line.endswith(")") and "cut.capture" in line]
    assert row.startswith("GOOD") and "(data was lost, its readable prefix checked: " in row, out
    assert "2 captures: 2 good, 0 bad, 0 cannot test" in out and "; 1 of them lost data" in out, out
