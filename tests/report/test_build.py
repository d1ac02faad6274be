"""`replay report` without a browser: the page says what the terminal says (the same verdict sentence, the same
first divergence as `--json`), its heat map holds one row per request and one cell per divergent (step, request),
it is one self-contained file, it stays small when the run is long, and the command line refuses what makes no
sense in one line with exit 2."""

from __future__ import annotations

import base64
import json
import re
import shutil

import numpy as np
import pytest

from replay.diff import Tolerance
from replay.diff.captures import diff_captures
from replay.errors import UsageError
from replay.report import write_report
from replay.report.bins import (
    EQUAL,
    FIRST_LEVEL,
    MAX_COLUMNS,
    MAX_ROWS,
    NOT_COMPARED,
    bin_starts,
)
from replay.report.run_facts import run_facts
from tests.report.chromium import Dom
from tests.report.helpers import cli, page_data


def _cells(data: dict) -> np.ndarray:
    hm = data["comparison"]["heatmap"]
    return np.frombuffer(base64.b64decode(hm["cells"]), np.uint8).reshape(hm["rows"], hm["cols"])


def _verdict_line(terminal: str) -> str:
    return next(line for line in terminal.splitlines() if line.startswith(("MATCH", "DIVERGED")))


def test_a_replay_report_leads_with_the_sentence_the_terminal_prints(bf16):
    verdict = _verdict_line(bf16.terminal)
    assert verdict.startswith("DIVERGED: ")
    assert bf16.code == 1 and bf16.stdout.splitlines() == [bf16.stdout.splitlines()[0], verdict]
    assert bf16.stdout.startswith(f"wrote {bf16.page} (")
    dom = Dom(bf16.page.read_text())
    assert dom.text["verdict"] == verdict
    assert bf16.json["repro"] in dom.text["commands"]  # the command that re-runs the first divergent step


def test_the_first_divergence_shown_is_the_one_json_reports(bf16):
    first, flip = bf16.json["first_divergence"], bf16.json["first_token_flip"]
    card = Dom(bf16.page.read_text()).by_id("first-divergence")
    assert (int(card["data-step"]), card["data-request"], int(card["data-position"]), card["data-kind"]) == (
        first["step"], first["request_id"], first["position"], first["kind"])
    if flip is not None:
        card = Dom(bf16.page.read_text()).by_id("first-flip")
        assert (int(card["data-step"]), card["data-request"]) == (flip["step"], flip["request_id"])


def test_the_heat_map_has_a_row_per_request_and_a_coloured_cell_per_divergent_step_and_request(bf16, recorded):
    data, facts = page_data(bf16.page), run_facts(recorded)
    cells = _cells(data)
    assert cells.shape == (len(facts.requests), len(facts.index))  # short run: no binning
    assert data["comparison"]["heatmap"]["row_labels"] == [f.name for f in facts.requests.values()]
    assert bf16.json["num_divergences"] == len(bf16.json["divergences"])  # the terminal's list is complete here
    divergent = {(d["step"], d["request_id"]) for d in bf16.json["divergences"]}
    assert int((cells >= FIRST_LEVEL).sum()) == len(divergent)
    names = [f.name for f in facts.requests.values()]
    for step, rid in divergent:
        assert cells[names.index(rid), step] >= FIRST_LEVEL
    scheduled = sum(b - a + 1 for f in facts.requests.values() for a, b in f.spans)
    assert int((cells > 0).sum()) == scheduled  # everything else that ran is drawn "equal"
    flips = [d for d in bf16.json["divergences"] if d["kind"] == "token"]
    assert len(data["comparison"]["heatmap"]["markers"]) == len({(d["step"], d["request_id"]) for d in flips})
    sc = data["comparison"]["scatter"]
    assert sc["tie"] + sc["confident"] == len(flips) and sc["shown"] + sc["no_margin"] == len(bf16.json["divergences"])


def test_a_self_replay_reports_a_match_and_every_cell_equal(recorded, tmp_path):
    code, out, _ = cli("report", str(recorded), "--diff", "-o", str(tmp_path / "self.html"))
    assert code == 0 and out.splitlines()[1] == "MATCH: every replayed step equals the recording"
    assert page_data(tmp_path / "self.html")["comparison"] is None  # nothing to map: no divergence


def test_a_match_within_a_tolerance_offers_the_commands_that_match_again(recorded, tmp_path):
    """A report of a MATCH within --atol offers the comparison again with that tolerance and those knobs (without,
    the command it offers diverges)."""
    page = tmp_path / "sdpa.html"
    code, out, _ = cli("report", str(recorded), "--diff", "--set", "attention=sdpa", "--atol", "1e-4", "-o", str(page))
    assert code == 0 and out.splitlines()[1].startswith("MATCH"), out
    commands = Dom(page.read_text()).text["commands"]
    for offered in (f"replay run {recorded} --diff --mode forced --atol 0.0001 --rtol 0 --set attention=sdpa",
                    f"replay report {recorded} --diff --mode forced --atol 0.0001 --rtol 0 --set attention=sdpa"):
        assert offered in commands, commands
        args = offered.split()[1:]
        code, out, _ = cli(*args, *["-o", str(tmp_path / "again.html")] * (args[0] == "report"))
        assert code == 0 and "MATCH" in out, out


def test_two_runs_report_the_verdict_and_first_divergence_of_replay_diff(two_runs, recorded, recorded_other):
    verdict = _verdict_line(two_runs.terminal)
    assert two_runs.code == 1 and two_runs.stdout.splitlines()[1] == verdict
    dom = Dom(two_runs.page.read_text())
    assert dom.text["verdict"] == verdict
    first, card = two_runs.json["first_divergence"], dom.by_id("first-divergence")
    assert (int(card["data-step"]), card["data-request"], int(card["data-position"])) == (
        first["a_step"], first["request_id"], first["position"])
    cells = _cells(page_data(two_runs.page))
    assert (cells >= FIRST_LEVEL).any() and (cells == EQUAL).any()
    text = two_runs.page.read_text()  # B's batch: its steps are not A's, so only the first divergence is marked
    assert "B: step " in text and "the first divergence&#x27;s request marked" in text
    if first["kind"] == "logprobs":  # in the terminal's words, not the JSON's kind
        assert "same token, " in dom.text["first-divergence"], dom.text["first-divergence"]
    res = diff_captures(recorded, recorded_other)
    if any(d for d in [res.first_divergence] if d.kind == "token"):
        assert (cells == NOT_COMPARED).any()  # after a token flip the runs are not compared


def test_the_run_alone_and_the_default_output_beside_the_capture(recorded, tmp_path):
    cap = tmp_path / "mine.capture"
    shutil.copy(recorded, cap)
    code, out, _ = cli("report", str(cap))
    page = tmp_path / "mine.report.html"
    assert code == 0 and out.startswith(f"wrote {page} (") and page.exists()
    data = page_data(page)
    assert data["comparison"] is None and data["requests"]["n"] == len(run_facts(cap).requests)
    assert 'id=comparison' not in page.read_text()


def test_a_bisect_verdict_is_shown_under_the_reports(recorded, tmp_path):
    code, out, _ = cli("bisect", "steps", str(recorded), "--set", "dtype=bfloat16", "--json")
    result = tmp_path / "bisect.json"
    result.write_text(out)
    code, _, _ = cli("report", str(recorded), "--bisect", str(result), "-o", str(tmp_path / "b.html"))
    assert code == 0
    card = Dom((tmp_path / "b.html").read_text()).by_id("bisect")
    assert card["data-verdict"] == json.loads(out)["verdict"]


def test_explains_class_and_evidence_are_shown_under_the_reports(recorded, recorded_other, tmp_path):
    code, out, _ = cli("explain", str(recorded), "--set", "dtype=bfloat16", "--json", "-q")
    result = tmp_path / "explain.json"
    result.write_text(out)
    code, _, _ = cli("report", str(recorded), "--diff", "--set", "dtype=bfloat16", "--explain", str(result),
                     "-o", str(tmp_path / "e.html"))
    assert code == 1  # the replay diverges; the explanation says it is the knob, no bug
    dom = Dom((tmp_path / "e.html").read_text())
    card = dom.by_id("explain")
    assert card["data-found"] == "CONFIG" and card["data-bug"] == "0"
    assert "changing dtype=bfloat16 alone" in (tmp_path / "e.html").read_text()
    code, out, err = cli("report", str(recorded_other), "--explain", str(result), "-o", str(tmp_path / "o.html"))
    assert code == 2 and not (tmp_path / "o.html").exists()  # its card would sit on the page of another run
    assert err.strip() == f"replay: {result}: an explanation of {recorded}, not of {recorded_other}: run it on this " \
                          "capture, or report that one"


def test_one_file_that_reaches_for_nothing_outside_itself(bf16):
    text = bf16.page.read_text()
    assert "Content-Security-Policy" in text and "default-src 'none'" in text
    assert not re.search(r"""\b(src|href)\s*=|@import|url\(|https?://""", text)


def test_a_long_wide_run_is_binned_to_the_plots_pixels(binned, big_synthetic):
    facts = run_facts(big_synthetic)
    assert binned.code == 1 and len(facts.index) > MAX_COLUMNS and len(facts.requests) > MAX_ROWS
    data = page_data(binned.page)
    hm = data["comparison"]["heatmap"]
    assert (hm["cols"], hm["rows"], len(hm["row_labels"])) == (MAX_COLUMNS, MAX_ROWS, MAX_ROWS)
    assert "…" in hm["row_labels"][0] and hm["markers"]  # a row holds several requests; every one flipped
    cells = _cells(data)
    assert (cells == NOT_COMPARED).any() and (cells >= FIRST_LEVEL).any()
    steps = data["steps"]
    assert steps["cols"] == MAX_COLUMNS and len(steps["prefill"]) == MAX_COLUMNS
    sizes = np.diff(np.append(bin_starts(steps["n"], MAX_COLUMNS), steps["n"]))
    assert abs(float(np.dot(steps["prefill"], sizes)) - facts.series["prefill"].sum()) < MAX_COLUMNS  # means x sizes
    assert max(steps["requests_max"]) == facts.series["requests"].max()  # a column's peak is its largest step
    assert binned.page.stat().st_size < 1_200_000  # the heat map: a byte per cell, 1,200 x 400 cells at most


def test_the_command_line_refuses_what_makes_no_sense_in_one_line(recorded, tmp_path):
    bad_json = tmp_path / "not-bisect.json"
    bad_json.write_text('{"steps": 3}')
    for args in (["--set", "dtype=bfloat16"], ["--runner", "builtin"], ["--atol", "1e-3"], [str(recorded), "--diff"],
                 ["--bisect", str(bad_json)], ["--bisect", str(tmp_path / "missing.json")],
                 ["--explain", str(bad_json)],
                 ["--diff", "--tolerance", "auto", "--atol", "1e-3"], ["-o", str(tmp_path / "no-dir" / "x.html")]):
        code, out, err = cli("report", str(recorded), *args)
        assert code == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith("replay: "), (args, err)


def test_a_tolerance_without_a_second_capture_is_refused_from_python(recorded, tmp_path):
    """`tolerance` judges a second capture; a replay's comes from its options, so one given alone would be ignored."""
    with pytest.raises(UsageError, match="judges a second capture"):
        write_report(recorded, tmp_path / "r.html", tolerance=Tolerance(atol=1e-3))
    assert not (tmp_path / "r.html").exists()
