"""`render_page`: the report as one HTML document. What reads as text (the verdict, the commands, the first
divergence, the batch, provenance) is static HTML, readable with scripts off; the plots and the request table are
drawn by the inline script (assets/report.js) from JSON embedded in the page. A Content-Security-Policy
forbids every load that is not inline, so the page cannot reach the network even by mistake."""

from __future__ import annotations

import functools
import html
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import msgspec

CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"


@functools.cache
def asset(name: str) -> str:
    """One of the page's own files (replay/report/assets/: report.css, watch.js, report.js), as text."""
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")



def esc(x: Any) -> str:
    """Text made safe for HTML."""
    return html.escape("" if x is None else str(x))


@dataclass(slots=True)
class Card:
    """A titled table of facts (the first divergence, the first token flip, a bisect's verdict)."""

    id: str
    title: str
    facts: list[tuple[str, Any]]
    attrs: dict[str, Any] = field(default_factory=dict)  # data-* attributes: what the tests read


@dataclass(slots=True)
class Bars:
    """A bar chart as a table: (label, value, the value as shown) per row, bars scaled to the largest value."""

    id: str
    title: str
    rows: list[tuple[str, float, str]]


@dataclass(slots=True)
class Batch:
    """A step's batch: each request's scheduled tokens; `marks[request]` is "first" or "diverged"."""

    title: str
    tokens: dict[str, int]
    marks: dict[str, str]


@dataclass(slots=True)
class Page:
    """Everything the page shows."""

    title: str
    subtitle: str
    verdict: str
    verdict_class: str  # match | diverged | none
    commands: list[tuple[str, str]]  # (what it does, the command)
    notes: list[str]
    stats: list[tuple[str, Any]]
    provenance: list[tuple[str, list[tuple[str, Any]]]]
    data: dict  # for the script: steps, requests, comparison
    cards: list[Card] = field(default_factory=list)
    batches: list[Batch] = field(default_factory=list)
    comparison_text: str = ""  # what is compared with what, and how
    legend: dict = field(default_factory=dict)  # heat map: lo, hi, equal label, whether "not compared" occurs
    bisect: Card | None = None  # a bisect's verdict, under the report's own
    explain: Card | None = None  # `replay explain`'s class and its evidence, under the report's own
    trainer: Card | None = None  # `replay trainer`'s figures, and its bars
    trainer_bars: list[Bars] = field(default_factory=list)


def _kv(facts: list[tuple[str, Any]]) -> str:
    return "<table class=kv>" + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts
                                        if v is not None) + "</table>"


def _card(c: Card) -> str:
    attrs = "".join(f" data-{k}=\"{esc(v)}\"" for k, v in c.attrs.items())
    return f"<div class=\"box card\" id=\"{c.id}\"{attrs}><h3>{esc(c.title)}</h3>{_kv(c.facts)}</div>"


def _bars(b: Bars) -> str:
    top = max((v for _, v, _ in b.rows), default=1) or 1
    rows = "".join(f"<tr><td>{esc(label)}</td><td class=num>{esc(text)}</td><td style=\"width:60%\"><div class=bar "
                   f"style=\"width:{max(0.5, 100 * v / top):.1f}%\"></div></td></tr>" for label, v, text in b.rows)
    return f"<div class=\"box card\" id=\"{esc(b.id)}\"><h3>{esc(b.title)}</h3><table class=data>{rows}</table></div>"


def _batch(b: Batch) -> str:
    top = max(b.tokens.values(), default=1) or 1
    rows = "".join(
        f"<tr data-request=\"{esc(r)}\"><td>{esc(r)}{' ◀ first divergence' if b.marks.get(r) == 'first' else ''}</td>"
        f"<td class=num>{n}</td><td style=\"width:60%\"><div class=\"bar {b.marks.get(r, '')}\" "
        f"style=\"width:{max(0.5, 100 * n / top):.1f}%\"></div></td></tr>" for r, n in b.tokens.items())
    return (f"<div class=\"box card batch\"><h3>{esc(b.title)}</h3><table class=data><tr><th>request</th>"
            f"<th class=num>tokens</th><th></th></tr>{rows}</table></div>")


def _legend(lg: dict) -> str:
    if not lg:
        return ""
    parts = ["<span><i class=sw style=\"background:#fff\"></i>not scheduled</span>",
             f"<span><i class=sw style=\"background:#7db9de\"></i>{esc(lg['equal'])}</span>"]
    if lg.get("not_compared"):
        parts.append("<span><i class=sw style=\"background:#cbcbcb\"></i>not compared (after a token flip)</span>")
    start = f"≤ atol {lg['atol']:g}" if lg.get("atol") else f"1e{lg['lo']}"
    parts += [f"<span>max |Δlogprob| {esc(start)}<i class=grad></i>1e{lg['hi']} (log)</span>",
              "<span><i class=ring></i>tie flip</span>", "<span><i class=dia></i>confident flip</span>",
              "<span><i class=sq></i>random draw</span>"]
    return "<div class=legend>" + "".join(parts) + "</div>"


def _comparison(p: Page) -> str:
    if not p.data.get("comparison"):
        return ""
    sc = p.data["comparison"]["scatter"]
    hm = p.data["comparison"]["heatmap"]
    steps = p.data["steps"]
    batches = ("<h3>The batch at the first divergence</h3><div class=cards>" + "".join(_batch(b) for b in p.batches)
               + "</div>" if p.batches else "")
    rows = ("one row per request in arrival order" if hm["rows"] == hm["requests"] else
            f"{hm['requests']:,} requests in {hm['rows']:,} rows of consecutive arrivals")
    cols = ("one column per step" if steps["cols"] == steps["n"] else
            f"{steps['n']:,} steps in {steps['cols']:,} columns")
    return f"""<section id=comparison><h2>Where and how it diverged</h2><p class=muted>{esc(p.comparison_text)}</p>
<h3>Steps × requests, coloured by the largest |Δlogprob| of the cell</h3>
<p class=muted>{rows.capitalize()}, {cols}; a cell shows the largest |Δlogprob| of what it holds. Hover a cell for
its numbers.</p>
<div class="plotrow hm"><div id=hm-rows></div>
<div id=hm-plot><canvas id=heatmap></canvas><canvas id=heatmap-overlay></canvas></div></div>
{_legend(p.legend)}
<div class=cards>{''.join(_card(c) for c in p.cards)}</div>
<h3>|Δlogprob| against the top1–top2 margin</h3>
<p class=muted>Each divergent position with a known margin: {sc['logprobs']:,} with logprobs differing on the same
token (grey), {sc['tie']:,} tie flips (blue rings: the margin is below the tie margin, or within twice the logprob
noise, the grey diagonal), {sc['confident']:,} confident flips (red: something other than rounding).
{sc['no_margin']:,} more have no top-2 logprobs to take a margin from. A |Δlogprob| of 0 (a flip with equal
logprobs) sits on the left edge.</p>
<canvas id=scatter></canvas>
{batches}</section>"""


def _timeline(p: Page) -> str:
    s = p.data["steps"]
    if not s.get("cols"):
        return "<p class=muted>No steps to show.</p>"
    time = ("<div class=plotrow><div class=lab><span>time per step (ms): schedule <i class=sw style=background:#a855f7>"
            "</i> execute <i class=sw style=background:#10b981></i> update <i class=sw style=background:#f97316></i>"
            "</span><span id=tl-time-max></span></div><canvas id=tl-time></canvas></div>" if s["timed"] else
            "<p class=muted>This capture records no step timings (a synthetic capture, say).</p>")
    return f"""<h3>Step timeline</h3><p class=muted>{esc(s['binning'])}; hover for numbers.</p>
<div class=plotrow><div class=lab><span>requests in the batch</span><span id=tl-batch-max></span></div>
<canvas id=tl-batch></canvas></div>
<div class=plotrow><div class=lab><span>tokens: prefill <i class=sw style=background:#f59e0b></i> decode
<i class=sw style=background:#3b82f6></i></span><span id=tl-tokens-max></span></div><canvas id=tl-tokens></canvas></div>
{time}
<div class=plotrow><div class=lab><span>preempted <i class=sw style=background:#dc2626></i> prefix hit
<i class=sw style=background:#16a34a></i></span></div><canvas id=tl-marks></canvas></div>
<div class=plotrow><div class=lab><span>step</span></div><canvas id=tl-axis></canvas></div>"""


def render_page(p: Page) -> str:
    """The whole document."""
    data = msgspec.json.encode(p.data).decode().replace("<", "\\u003c")  # nothing in it can close the script
    commands = "".join(f"<div class=muted>{esc(what)}</div><pre class=cmd>{esc(cmd)}</pre>" for what, cmd in p.commands)
    notes = ("<ul class=notes>" + "".join(f"<li>{esc(n)}</li>" for n in p.notes) + "</ul>") if p.notes else ""
    stats = "".join(f"<div class=stat><b>{esc(v)}</b><span>{esc(k)}</span></div>" for k, v in p.stats)
    prov = "".join(f"<div class=\"box card\"><h3>{esc(t)}</h3>{_kv(f)}</div>" for t, f in p.provenance if f)
    only = ("<label><input type=checkbox id=req-only> only requests that diverged</label>"
            if p.data.get("comparison") else "")
    bisect = "".join(_card(c) for c in (p.explain, p.bisect, p.trainer) if c is not None)
    bisect += "".join(_bars(b) for b in p.trainer_bars)
    return f"""<!DOCTYPE html>
<html lang=en><head><meta charset=utf-8><meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name=viewport content="width=device-width, initial-scale=1"><title>{esc(p.title)}</title>
<style>{asset("report.css")}</style>
<script>{asset("watch.js")}</script></head>
<body data-status=loading><main>
<h1>{esc(p.title)}</h1><p class=sub>{esc(p.subtitle)}</p>
<div id=errors hidden></div>
<p id=verdict class="verdict {p.verdict_class}">{esc(p.verdict)}</p>{notes}<div id=commands>{commands}</div>{bisect}
<div class=stats id=stats>{stats}</div>
{_comparison(p)}
<section id=run><h2>The run</h2>{_timeline(p)}</section>
<section id=requests><h2>Requests</h2>
<div class=controls><input type=search id=req-filter placeholder="filter by request id or status">
{only}<span id=req-count class=muted></span></div>
<div class=tablewrap><table class=data><thead><tr id=req-head></tr></thead><tbody id=req-body></tbody></table></div>
<button id=req-more hidden>show more</button></section>
<section id=provenance><h2>Provenance</h2><div class=cards>{prov}</div></section>
</main><div id=tip hidden></div>
<script type="application/json" id=report-data>{data}</script>
<script>{asset("report.js")}</script></body></html>
"""
