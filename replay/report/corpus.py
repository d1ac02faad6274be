"""`write_corpus_report`: the answer of `replay check CORPUS` (or its results file) as one self-contained HTML
page: the summary sentence, the groups of provenance differences that explain the divergences, and a row per
capture (the diverging ones first). Static HTML, no script: it reads the same in any browser, from disk, offline."""

from __future__ import annotations

import html
import os
import time
from pathlib import Path

import msgspec

from replay import __version__
from replay.errors import EXIT_CANNOT_TEST, EXIT_DIVERGED, EXIT_OK, UsageError
from replay.replayer.corpus import CorpusResult, CorpusRow, corpus_groups
from replay.report.page import CSP, asset

_ORDER = {EXIT_DIVERGED: 0, EXIT_CANNOT_TEST: 1, EXIT_OK: 2}


class CorpusReport(msgspec.Struct):
    """What was written."""

    path: str
    bytes: int
    captures: int
    bad: int  # captures that diverge: `replay report RESULTS` exits 1 when there is one
    summary: str


def read_results_file(path: str | os.PathLike) -> list[CorpusRow]:
    """The rows of a `--results` file, in the order they finished (a torn line is skipped); UsageError if it is
    not one."""
    dec = msgspec.json.Decoder(CorpusRow)
    rows = []
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror or e})") from None
    for line in lines:
        try:
            rows.append(dec.decode(line))
        except msgspec.DecodeError:
            continue
    if not rows:
        raise UsageError(f"{path}: not a results file of `replay check CORPUS --results` (no row in it)")
    return rows


def is_results_file(path: str | os.PathLike) -> bool:
    """Whether `path` starts with a row of a `--results` file (a capture starts with binary frames)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(65536)
        msgspec.json.decode(first, type=CorpusRow)
        return True
    except (OSError, msgspec.DecodeError):
        return False


def _e(x: object) -> str:
    return html.escape(str(x))


def _why(r: CorpusRow) -> str:
    """Why a row could not be tested, or what its capture lost (its readable prefix was checked)."""
    if r.code == EXIT_CANNOT_TEST:
        return r.reason
    return f"data was lost, its readable prefix checked: {r.data_lost}" if r.data_lost else ""


def write_corpus_report(result: CorpusResult | list[CorpusRow], output: str | os.PathLike) -> CorpusReport:
    """Write the page for a corpus check (its result, or the rows of its results file)."""
    rows = result.rows if isinstance(result, CorpusResult) else list(result)
    groups = result.groups if isinstance(result, CorpusResult) else corpus_groups(rows)
    good = sum(r.code == EXIT_OK for r in rows)
    bad = sum(r.code == EXIT_DIVERGED for r in rows)
    cannot = len(rows) - good - bad
    lost = sum(bool(r.data_lost) for r in rows)
    summary = f"{len(rows)} captures: {good} good, {bad} bad, {cannot} cannot test" + (
        f"; {lost} of them lost data" if lost else "")
    kind = "diverged" if bad else "match" if good else "none"
    group_rows = "".join(
        f"<tr><td class='num'>{g.diverged} of {g.captures}</td><td class='num'>{g.cannot_test}</td>"
        f"<td>{_e(g.label)}"
        f"</td></tr>" for g in groups)
    body = "".join(
        f"<tr class='{'diverged' if r.code == EXIT_DIVERGED else ''}'><td>{_e(r.verdict.upper())}</td>"
                    f"<td>{_e(r.capture)}</td><td>{_e(r.first_divergence)}</td><td>{_e(r.suspect)}</td>"
        f"<td class='num'>{r.seconds:.1f}</td><td>{_e(_why(r))}</td></tr>"
        for r in sorted(rows, key=lambda r: (_ORDER.get(r.code, 1), r.capture)))
    page = f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<title>replay check: {_e(summary)}</title><style>{asset("report.css")}</style></head><body><main>
<h1>replay check: a corpus of {len(rows)} captures</h1>
<p class="sub">report written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by replay {__version__}</p>
<div class="verdict {kind}" id="verdict">{_e(summary)}</div>
<h2>What differs from this runner, and what diverged there</h2>
<table class="data" id="groups"><thead><tr><th>diverge</th><th>cannot test</th><th>recorded differently from this
runner in</th></tr></thead><tbody>{group_rows}</tbody></table>
<h2>Captures</h2><p class="muted">diverging first, then those that could not be tested, then the good ones</p>
<div class="tablewrap"><table class="data" id="rows">
<thead><tr><th>verdict</th><th>capture</th><th>first divergence</th>
<th>suspect</th><th>seconds</th><th>why it could not be tested, or what it lost</th></tr></thead>
<tbody>{body}</tbody></table></div>
</main></body></html>
"""
    out = Path(output)
    out.write_text(page)
    return CorpusReport(str(out), out.stat().st_size, len(rows), bad, summary)
