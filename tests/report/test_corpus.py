"""The page of a corpus check: written by `replay check CORPUS --report` and by `replay report RESULTS.jsonl` from the
results file, one row per capture (the diverging first), the groups, the summary; opened in headless Chromium with
the network blocked, nothing on the console."""

from __future__ import annotations

import os

import pytest

from replay.cli import main
from replay.record import EngineOptions, SyntheticWorkload, record, synthetic
from replay.report.corpus import is_results_file, read_results_file
from tests.report.chromium import Dom, load, needs_chromium


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for i in range(3):
        record(EngineOptions(model="tiny", threads=1), synthetic(SyntheticWorkload(num_requests=3, output_len=(2, 4),
                                                                                   seed=i), 512), d / f"w{i}.capture")
    data = (d / "w0.capture").read_bytes()
    (d / "cut.capture").write_bytes(data[:200])  # nothing readable: cannot test
    return d


def test_check_writes_the_page_and_report_rewrites_it_from_the_results_file(corpus, tmp_path, capsys):
    results, page, again = tmp_path / "r.jsonl", tmp_path / "check.html", tmp_path / "again.html"
    assert main(["check", str(corpus), "--set", "dtype=bfloat16", "--results", str(results),
                 "--report", str(page)]) == 1
    capsys.readouterr()
    assert is_results_file(results) and not is_results_file(corpus / "w0.capture")
    assert main(["report", str(results), "-o", str(again)]) == 1  # something diverges
    assert "4 captures: 0 good, 3 bad, 1 cannot test" in capsys.readouterr().out
    for html in (page, again):
        dom = Dom(html.read_text())
        assert dom.text["verdict"] == "4 captures: 0 good, 3 bad, 1 cannot test"
        rows = [r for r in dom.inside("tr", "rows")][1:]  # the header row first
        assert len(rows) == 4
    text = page.read_text()
    assert text.index(">BAD<") < text.index(">CANNOT TEST<")  # the diverging captures first
    assert len(read_results_file(results)) == 4


def test_a_good_row_whose_capture_lost_data_says_so(tmp_path):
    from replay.replayer.corpus import CorpusRow
    from replay.report.corpus import write_corpus_report

    rows = [CorpusRow("a.capture", "good", 0, "a.capture: replays", 1.0, "k"),
            CorpusRow("b.capture", "good", 0, "b.capture: replays", 1.0, "k", data_lost="truncated: chunk 3")]
    page = tmp_path / "lost.html"
    write_corpus_report(rows, page)
    dom = Dom(page.read_text())
    assert dom.text["verdict"] == "2 captures: 2 good, 0 bad, 0 cannot test; 1 of them lost data"
    assert "data was lost, its readable prefix checked: truncated: chunk 3" in page.read_text()


@needs_chromium
def test_the_page_opens_offline_without_a_console_line(corpus, tmp_path, capsys):
    page = tmp_path / "check.html"
    assert main(["check", str(corpus), "--report", str(page)]) == 0  # good, plus one that cannot be tested
    capsys.readouterr()
    dom, _, console = load(page, tmp_path / "profile")
    assert dom.text["verdict"] == "4 captures: 3 good, 0 bad, 1 cannot test" and console == []
    assert os.path.getsize(page) < 50_000
