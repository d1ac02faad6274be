"""The CLI contract, walked over every command and every option the app declares (new ones are covered the day they
are added): a wrong value never produces a traceback; a failure is exactly one line on stderr, `replay: ...`, with
a documented exit code; a value of the wrong type is exit 2; and `-v` is what turns the traceback back on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import typer

from replay.cli import app, main

GOLDEN = str(Path(__file__).resolve().parents[2] / "captures" / "tiny-mixed.capture")
CODES = {0, 1, 2, 3, 125}


def _commands() -> list[tuple[tuple[str, ...], object]]:
    """(command path, click command) for every leaf command."""
    out = []

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in sorted(subs.items()):
                walk(sub, (*path, name))
        else:
            out.append((path, cmd))

    walk(typer.main.get_command(app), ())
    return out


def _base(path: tuple[str, ...], tmp: Path) -> tuple[list[str], dict[str, list[str]]]:
    """Arguments that make each command valid and quick: (positional arguments, options by their flag)."""
    out = str(tmp / "out.capture")
    runs = {"--steps": ["0-1"]}
    ring = tmp / "ring"  # a ring a stopped recorder left: one closed segment
    if path == ("snapshot",) and tmp.is_dir() and not ring.exists():
        ring.mkdir()
        shutil.copy(GOLDEN, ring / "segment-000001.capture")
    table: dict[tuple[str, ...], tuple[list[str], dict[str, list[str]]]] = {
        ("info",): ([GOLDEN], {}), ("show",): ([GOLDEN], {"--step": ["1"]}),
        ("export",): ([GOLDEN], {"-o": [str(tmp / "x.jsonl")]}),
        ("recover",): ([GOLDEN], {"-o": [out]}), ("synth",): ([out], {"--steps": ["2"], "--running": ["2"]}),
        ("run",): ([GOLDEN], runs), ("check",): ([GOLDEN], {}), ("diff",): ([GOLDEN, GOLDEN], {}),
        ("record",): ([], {"--num-requests": ["1"], "--prompt-len": ["2:2"], "--output-len": ["1:1"], "-o": [out]}),
        ("demo",): ([], {"-o": [out]}), ("snapshot",): ([str(ring)], {}),
        ("report",): ([GOLDEN], {"-o": [str(tmp / "report.html")]}),
        ("stress",): ([], {"--prompt-token-ids": ["5,6"], "--trials": ["2"], "--max-tokens": ["1"],
                           "--neighbours": ["0:0"]}),
        ("bisect", "steps"): ([GOLDEN], {}),
        ("bisect", "batch"): ([GOLDEN], {"--step": ["1"], "--request": ["req-0"], "-q": []}),
        ("bisect", "layers"): ([GOLDEN], {"--step": ["1"], "--request": ["req-0"], "-q": []}),
        ("bisect", "config"): ([GOLDEN], {"--bad": ["dtype=bfloat16"], "--steps": ["0-1"], "-q": []}),
        ("bisect", "leak"): ([GOLDEN], {"--step": ["1"], "--request": ["req-0"], "-q": []}),
        ("explain",): ([GOLDEN], {"--step": ["1"], "-q": []}),
        ("trainer",): ([GOLDEN], {}),  # the builtin `tiny` is no checkpoint: refused in a line, whatever the option
        ("bisect", "dumps"): ([str(tmp / "dump-a"), str(tmp / "dump-b")], {}),  # no dumps there: refused, in a line
    }
    return table[path]


def _bad_values(param) -> list[tuple[str, bool]]:
    """(value, whether it must be refused) for an option, by its declared type."""
    kind = param.bare_type()  # the annotation typer parses the value into
    if kind == "int":
        return [("seven", True), ("-99999", False)]
    if kind == "float":
        return [("x1.5", True), ("-1e9", False)]
    if kind == "Path":  # under a regular file: neither readable nor creatable (the test writes nothing elsewhere)
        return [("{tmp}/a-file/x", False)]
    return [("%%junk%%", False), ("", False)]


def _cases():
    for path, cmd in _commands():
        for param in cmd.params:
            if param.param_type_name != "option" or getattr(param, "is_flag", False) or param.name == "help":
                continue
            for value, refused in _bad_values(param):
                yield pytest.param(path, param.opts[0], value, refused,
                                   id=f"{' '.join(path)} {param.opts[0]}={value!r}")


def test_every_command_is_walked():
    names = {" ".join(p) for p, _ in _commands()}
    assert {"record", "run", "check", "diff", "info", "show", "export", "recover", "synth", "demo", "stress",
            "bisect steps", "bisect batch", "bisect layers", "bisect config"} <= names


@pytest.mark.parametrize("path,flag,value,refused", list(_cases()))
def test_no_option_value_produces_a_traceback(tmp_path, capsys, path, flag, value, refused):
    args, options = _base(path, tmp_path)
    options = {k: v for k, v in options.items() if k != flag and not (flag == "--output" and k == "-o")}
    (tmp_path / "a-file").write_text("a file, not a directory\n")
    argv = [*path, *args, *[x for k, v in options.items() for x in (k, *v)], flag, value.format(tmp=tmp_path)]
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and code in CODES, (code, err)
    if refused:  # (`check` answers 125 for what it cannot parse: `git bisect run` skips, never blames)
        assert code == (125 if path == ("check",) else 2), (code, err)
    if code not in (0, 1):
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("replay: "), err


@pytest.mark.parametrize("what", ["missing", "directory", "empty", "not a capture"])
@pytest.mark.parametrize("path", [p for p, _ in _commands() if _base(p, Path("/tmp"))[0]], ids=" ".join)
def test_every_capture_argument_refuses_what_is_not_a_capture(tmp_path, capsys, path, what):
    bad = {"missing": tmp_path / "nope.capture", "directory": tmp_path, "empty": tmp_path / "empty.capture",
           "not a capture": tmp_path / "text.capture"}[what]
    (tmp_path / "empty.capture").write_bytes(b"")
    (tmp_path / "text.capture").write_text("hello\n")
    args, options = _base(path, tmp_path)
    if path == ("synth",):  # its argument is an output: a directory or an existing file is what it refuses
        if what in ("missing", "not a capture"):
            return
    argv = [*path, str(bad), *args[1:], *[x for k, v in options.items() for x in (k, *v)]]
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    # a command that reads a set (a directory of captures) says one line per capture it could not read
    assert code in (2, 125) and lines and all(x.startswith("replay: ") and str(bad) in x for x in lines), err
    assert len(lines) == (2 if what == "directory" and path in (("info",), ("run",)) else 1), err


def test_verbose_shows_the_traceback_of_an_error(capsys):
    assert main(["-v", "info", "/nonexistent/x.capture"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == "replay: /nonexistent/x.capture: no such file"


def test_an_internal_error_is_one_line_and_verbose_shows_it(capsys, monkeypatch):
    import replay.inspect

    def boom(path):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(replay.inspect, "capture_info", boom)
    assert main(["info", GOLDEN]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("replay: internal error, please report it: ZeroDivisionError: a bug "
                           "(`replay -v ...` shows where)")
    monkeypatch.setenv("REPLAY_VERBOSE", "1")
    assert main(["info", GOLDEN]) == 2
    assert "Traceback" in capsys.readouterr().err
