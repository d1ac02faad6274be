"""The command line through typer's runner: results on stdout, one-line errors on stderr, exit codes."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from replay.capture.format import records as fmt
from replay.cli import app, main

runner = CliRunner()


def invoke(*args):
    """Run `replay ARGS` in-process; returns typer's Result (stdout / stderr / exit_code)."""
    return runner.invoke(app, [str(a) for a in args])


def test_info_human_and_json(small_capture):
    res = invoke("info", small_capture)
    assert res.exit_code == 0, res.stderr
    assert "steps     40 (0-39)" in res.stdout and "damage    none" in res.stdout
    res = invoke("info", small_capture, "--json")
    data = json.loads(res.stdout)
    assert data["num_steps"] == 40 and data["damage"] == [] and data["header"]["engine"] == "synthetic"


def test_show_one_step_a_range_and_a_request(small_capture):
    res = invoke("show", small_capture, "--step", "7")
    assert res.exit_code == 0 and res.stdout.startswith("step 7:")
    data = json.loads(invoke("show", small_capture, "--step", "3-5", "--json").stdout)
    assert [s["index"] for s in data["steps"]] == [3, 4, 5]
    assert data["steps"][0]["type"] == "step"
    res = invoke("show", small_capture, "--request", "req-2", "--json")
    data = json.loads(res.stdout)
    assert data["steps"] and all(data["request"] in s["scheduler_output"]["num_scheduled_tokens"]
                                 or data["request"] in s["scheduler_output"]["finished_req_ids"] for s in data["steps"])


def test_show_a_range_keeps_its_limit_and_the_external_ids(small_capture):
    data = json.loads(invoke("show", small_capture, "--step", "10-30", "--limit", "3", "--json").stdout)
    assert [s["index"] for s in data["steps"]] == [10, 11, 12]
    scheduled = {rid for s in data["steps"] for rid in s["scheduler_output"]["num_scheduled_tokens"]}
    assert scheduled and scheduled <= set(data["external_ids"])  # arrivals read from chunks before the range
    text = invoke("show", small_capture, "--step", "10").stdout
    assert "(req-" in text


def test_export_jsonl_has_one_object_per_record(small_capture, tmp_path):
    out = tmp_path / "x.jsonl"
    res = invoke("export", small_capture, "-o", out)
    assert res.exit_code == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["type"] == "header" and lines[-1]["type"] == "footer"
    steps = [r for r in lines if r["type"] == "step"]
    assert len(steps) == 40
    lp = steps[5]["model_runner_output"]["logprobs"]["logprobs"]
    assert lp["dtype"] == "float32" and len(lp["values"]) == lp["shape"][0]


def test_recover_exit_codes(small_capture, tmp_path):
    data = small_capture.read_bytes()
    index_at = struct.unpack_from("<Q", data, len(data) - 16)[0]
    partial = tmp_path / "run.capture.partial"
    partial.write_bytes(data[: index_at - 40])  # a crash mid-way through the last chunk
    res = invoke("recover", partial)
    assert res.exit_code == 3 and "lost:" in res.stdout
    res = invoke("info", tmp_path / "run.capture")
    assert res.exit_code == 0 and "the capture it was recovered from lost data" in res.stdout
    res = invoke("recover", small_capture, "-o", tmp_path / "same.capture")
    assert res.exit_code == 0 and "nothing was lost" in res.stdout
    assert "damage    none\n" in invoke("info", tmp_path / "same.capture").stdout + "\n"
    (tmp_path / "tiny.capture").write_bytes(data[:25])
    res = invoke("recover", tmp_path / "tiny.capture")
    assert res.exit_code == 1 and "nothing recoverable" in res.stderr


def _file(path, content: bytes):
    path.write_bytes(content)
    return path


def _newer(path, tmp_path):
    data = bytearray(path.read_bytes())
    struct.pack_into("<HH", data, 16, fmt.FORMAT_MAJOR + 1, 0)
    p = tmp_path / "newer.capture"
    p.write_bytes(bytes(data))
    return p


def _corrupted(path, tmp_path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    p = tmp_path / "corrupt.capture"
    p.write_bytes(bytes(data))
    return p


def _empty_dir(path):
    path.mkdir()
    return path


def _truncated(path, tmp_path):
    p = tmp_path / "trunc.capture"
    p.write_bytes(path.read_bytes()[: len(path.read_bytes()) * 2 // 3])
    return p


@pytest.mark.parametrize("command", ["info", "show", "export", "recover"])
@pytest.mark.parametrize(
    "make, code, message",
    [
        (lambda p, t: t / "missing.capture", 2, "no such file"),
        # a directory: a capture set for info (this one holds none), not a capture for the others
        (lambda p, t: _empty_dir(t / "no-captures"), 2, "directory"),
        (lambda p, t: _file(t / "empty.capture", b""), 2, "empty file"),
        (lambda p, t: _file(t / "text.capture", b"hello\n"), 2, "not a replay capture"),
        (_newer, 2, "upgrade replay"),
        (_truncated, 3, "damaged"),
        (_corrupted, 3, "damaged"),
    ],
    ids=["missing", "directory", "empty", "not-a-capture", "newer-version", "truncated", "corrupted"],
)
def test_bad_input_is_one_line_and_the_right_exit_code(small_capture, tmp_path, command, make, code, message):
    path = make(small_capture, tmp_path)
    args = [command, path] + (["--step", "0-"] if command == "show" else [])
    args += ["-o", tmp_path / "out.x"] if command in ("export", "recover") else []
    res = invoke(*args)
    if command == "recover" and code == 3:
        assert res.exit_code == 3 and "lost:" in res.stdout
        return
    assert res.exit_code == code, (res.stdout, res.stderr)
    err = res.stderr.strip().splitlines()
    assert message in res.stderr and all(line.startswith("replay: ") for line in err)
    assert "Traceback" not in res.stderr + res.stdout


def test_usage_errors_exit_2_in_one_line(capsys):
    assert main(["info"]) == 2
    assert main(["info", "x", "--bogus"]) == 2
    assert main(["show", "x", "--step", "9-3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("replay: ") for line in err)


def test_root_cli_py_hands_over_to_the_package(small_capture):
    out = subprocess.run([sys.executable, "cli.py", "info", str(small_capture), "--json"], capture_output=True,
                         text=True,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.returncode == 0 and json.loads(out.stdout)["num_steps"] == 40


def test_read_commands_do_not_import_torch(small_capture):
    code = ("import sys; from replay.cli import main; rc = main(['info', sys.argv[1]]); "
            "print('torch' in sys.modules); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(small_capture)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("False")


def test_help_lists_the_commands_in_the_order_of_a_users_day_and_points_at_the_recipes(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    block = out.split("Commands:", 1)[1].split("\n\n", 1)[0]  # up to the epilog
    listed = [line.split()[0] for line in block.splitlines() if line.startswith("  ") and line.split()]
    assert listed[:12] == ["record", "snapshot", "run", "diff", "explain", "trainer", "info", "show", "report",
                           "bisect", "stress", "check"], listed
    assert set(listed[12:]) == {"recover", "export", "synth", "demo"}
    assert "README.md" in out and "docs/guide.md" in out



@pytest.mark.parametrize("cmd", [["run", "{c}", "--diff"], ["check", "{c}"], ["stress", "{c}"],
                                 ["bisect", "batch", "{c}", "--step", "3", "--request", "r0"]])
def test_runner_and_a_set_runner_that_disagree_are_refused(small_capture, cmd):
    args = [str(small_capture) if a == "{c}" else a for a in cmd]
    res = runner.invoke(app, [*args, "--runner", "vllm", "--set", "runner=builtin"])
    assert res.exit_code in (2, 125) and "say two things" in res.stderr, res.output


def test_a_set_with_an_unreadable_capture_still_reports_every_other_one(tmp_path, capsys):
    """Data-parallel ranks, a directory, a glob: one capture that cannot be read is one line naming it, and the
    captures after it are still read and replayed (a later rank's divergence must not hide behind it)."""
    from replay.record import EngineOptions, SyntheticWorkload, record, synthetic

    wl = SyntheticWorkload(num_requests=2, prompt_len=(4, 6), output_len=(2, 3), seed=1)
    record(EngineOptions(model="tiny", threads=1), synthetic(wl, 512), tmp_path / "b-good.capture")
    (tmp_path / "a-junk.capture").write_bytes(b"not a capture at all")
    capsys.readouterr()
    assert main(["info", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "a-junk.capture" in err and "not a replay capture" in err and "b-good.capture" in out
    assert main(["run", str(tmp_path / "*.capture"), "--diff"]) == 2
    out, err = capsys.readouterr()
    assert "a-junk.capture" in err and "MATCH" in out
    # a divergence among them is the verdict's exit code, whatever the unreadable one's
    assert main(["run", str(tmp_path / "*.capture"), "--diff", "--set", "dtype=bfloat16"]) == 1
    out, err = capsys.readouterr()
    assert "a-junk.capture" in err and "DIVERGED" in out
    # with --json every capture of the set is one object of the stream, the unreadable one too
    assert main(["info", str(tmp_path), "--json"]) == 2
    junk, good = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert junk["capture"].endswith("a-junk.capture") and junk["exit_code"] == 2 and "not a replay capture" in \
        junk["error"]
    assert good["num_steps"] > 0


def _on_a_terminal(*args: str) -> tuple[int, str]:
    """Run the CLI's entry point (in this process, which has torch imported already) with its stderr on a
    pseudo-terminal, where progress lines show; (exit code, what stderr got)."""
    import os
    import pty
    import threading

    master, slave = pty.openpty()
    got: list[bytes] = []

    def drain() -> None:  # (as the terminal does: a full pseudo-terminal would block the writer)
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # (the terminal's other end is closed and drained)
                break
            if not chunk:
                break
            got.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    saved, sys.stderr = sys.stderr, open(slave, "w", buffering=1)  # noqa: SIM115 - closed below, by hand
    try:
        code = main(list(args))
    finally:
        sys.stderr.close()
        sys.stderr = saved
        reader.join(timeout=30)
        os.close(master)
    return code, b"".join(got).decode()


def test_progress_shows_on_a_terminal_and_quiet_silences_it(tmp_path):
    """`record`'s bar and the replays' `replayed step N` line draw on a terminal; `-q` leaves them out."""
    capture = str(tmp_path / "two.capture")
    record = ("record", "--num-requests", "2", "--max-tokens", "4", "--threads", "1", "--out", capture, "--force")
    code, said = _on_a_terminal(*record)
    assert code == 0 and "recording" in said, said
    code, said = _on_a_terminal(*record, "-q")
    assert code == 0 and "recording" not in said, said
    code, said = _on_a_terminal("run", capture, "--diff")
    assert code == 0 and "replayed step 1" in said, said
    page = str(tmp_path / "r.html")
    for command in (("run", capture), ("check", capture), ("report", capture, "--diff", "-o", page),
                    ("bisect", "steps", capture), ("explain", capture)):
        code, said = _on_a_terminal(*command, "-q")
        assert code == 0 and "replayed step" not in said, (command, said)
