"""`render_page`: the report as one HTML document. What reads as text (the verdict, the commands, the first
divergence, the batch, provenance) is static HTML, readable with scripts off; the plots and the request table are
drawn by the inline script (`replay.report.script`) from JSON embedded in the page. A Content-Security-Policy
forbids every load that is not inline, so the page cannot reach the network even by mistake."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

import msgspec

from replay.report.script import SCRIPT, WATCH

CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"
STYLE = """
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#0f172a;background:#f8fafc}
main{max-width:1400px;margin:0 auto;padding:20px 28px 60px}h1{font-size:20px;margin:0 0 2px}h2{font-size:16px;margin:28px 0 8px}
h3{font-size:14px;margin:14px 0 6px}.sub{color:#64748b;margin:0 0 14px}code,pre{font:12.5px ui-monospace,SFMono-Regular,Menlo,monospace}
.verdict{font-size:17px;font-weight:600;padding:12px 16px;border-radius:8px;margin:10px 0;border:1px solid}
.verdict.match{background:#ecfdf5;border-color:#6ee7b7;color:#065f46}.verdict.diverged{background:#fff1f2;border-color:#fda4af;color:#9f1239}
.verdict.none{background:#f1f5f9;border-color:#cbd5e1;color:#334155}
pre.cmd{background:#0f172a;color:#e2e8f0;padding:8px 12px;border-radius:6px;overflow-x:auto;margin:4px 0}
.notes{color:#92400e;margin:6px 0;padding-left:18px}.box{background:#fff;border:1px solid #e2e8f0;border-radius:8px;padding:12px 16px}
.cards{display:flex;flex-wrap:wrap;gap:12px}.card{flex:1 1 300px}.kv{border-collapse:collapse;width:100%}
.kv th{text-align:left;font-weight:500;color:#475569;padding:2px 12px 2px 0;vertical-align:top;white-space:nowrap;width:1%}
.kv td{padding:2px 0;word-break:break-word}.stats{display:flex;flex-wrap:wrap;gap:10px;margin:8px 0}
.stat{background:#fff;border:1px solid #e2e8f0;border-radius:8px;padding:8px 14px;min-width:130px}
.stat b{display:block;font-size:18px}.stat span{color:#64748b;font-size:12px}
.plotrow{display:grid;grid-template-columns:150px 1fr;align-items:stretch;margin:2px 0}
.plotrow .lab{font-size:11.5px;line-height:1.25;color:#475569;padding-right:8px;text-align:right;display:flex;flex-direction:column;justify-content:space-between}
.plotrow canvas{width:100%;display:block;background:#fff;border:1px solid #e2e8f0}
#tl-batch,#tl-tokens,#tl-time{height:90px}#tl-marks{height:28px}#tl-axis{height:20px;border:0!important;background:none!important}
.plotrow.hm{grid-template-columns:max-content minmax(0,1fr)}
#hm-rows{display:flex;flex-direction:column;font-size:11px;color:#334155;text-align:right;padding-right:8px;min-width:142px}
.hm-row{white-space:nowrap;line-height:1;display:flex;align-items:center;justify-content:flex-end}
.hm-row.tiny{font-size:0}#hm-plot{position:relative;border:1px solid #e2e8f0;background:#fff}
#heatmap{position:absolute;inset:0;width:100%;height:100%;image-rendering:pixelated}
#heatmap-overlay{position:absolute;inset:0;width:100%;height:100%}#hm-plot canvas{background:transparent;border:0}#scatter{width:100%;max-width:760px;height:340px;background:#fff;border:1px solid #e2e8f0;display:block}
.legend{display:flex;flex-wrap:wrap;gap:16px;align-items:center;font-size:12px;color:#334155;margin:6px 0 6px 150px}
.sw{display:inline-block;width:12px;height:12px;border:1px solid #cbd5e1;vertical-align:-2px;margin-right:4px}
.grad{display:inline-block;width:160px;height:12px;vertical-align:-2px;margin:0 4px;border:1px solid #cbd5e1;
background:linear-gradient(90deg,#fcfdbf,#feb078,#f1605d,#b73779,#721f81,#2c115f,#000004)}
.ring{display:inline-block;width:11px;height:11px;border:2px solid #2563eb;border-radius:50%;vertical-align:-2px;margin-right:4px}
.sq{display:inline-block;width:10px;height:10px;border:2px solid #7c3aed;vertical-align:-2px;margin-right:4px}
.dia{display:inline-block;width:9px;height:9px;background:#e11d48;transform:rotate(45deg);margin:0 5px 0 2px}
.bar{height:14px;background:#94a3b8;border-radius:2px}.bar.first{background:#e11d48}.bar.diverged{background:#f59e0b}
table.data{border-collapse:collapse;width:100%;background:#fff;font-size:12.5px}
table.data th,table.data td{padding:3px 8px;border-bottom:1px solid #eef2f7;text-align:left;white-space:nowrap}
table.data th{position:sticky;top:0;background:#f1f5f9;cursor:pointer;user-select:none}table.data .num{text-align:right}
table.data th[aria-sort=ascending]::after{content:" \\25B2"}table.data th[aria-sort=descending]::after{content:" \\25BC"}
tr.diverged td:first-child{border-left:3px solid #f59e0b}tr.flipped td:first-child{border-left:3px solid #e11d48}
.tablewrap{max-height:560px;overflow:auto;border:1px solid #e2e8f0;border-radius:6px}
.controls{display:flex;gap:14px;align-items:center;margin:6px 0}.controls input[type=search]{padding:4px 8px;width:260px}
#tip{position:fixed;z-index:10;background:#0f172a;color:#f8fafc;font-size:12px;padding:6px 8px;border-radius:5px;white-space:pre;pointer-events:none}
#errors{background:#fef2f2;color:#991b1b;border:1px solid #fca5a5;padding:8px;white-space:pre-wrap}
details summary{cursor:pointer;color:#475569}.muted{color:#64748b}
"""


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


def _kv(facts: list[tuple[str, Any]]) -> str:
    return "<table class=kv>" + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts
                                        if v is not None) + "</table>"


def _card(c: Card) -> str:
    attrs = "".join(f" data-{k}=\"{esc(v)}\"" for k, v in c.attrs.items())
    return f"<div class=\"box card\" id=\"{c.id}\"{attrs}><h3>{esc(c.title)}</h3>{_kv(c.facts)}</div>"


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
<div class="plotrow hm"><div id=hm-rows></div><div id=hm-plot><canvas id=heatmap></canvas><canvas id=heatmap-overlay></canvas></div></div>
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
<div class=plotrow><div class=lab><span>requests in the batch</span><span id=tl-batch-max></span></div><canvas id=tl-batch></canvas></div>
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
    bisect = _card(p.bisect) if p.bisect is not None else ""
    return f"""<!DOCTYPE html>
<html lang=en><head><meta charset=utf-8><meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name=viewport content="width=device-width, initial-scale=1"><title>{esc(p.title)}</title><style>{STYLE}</style>
<script>{WATCH}</script></head>
<body data-status=loading><main>
<h1>{esc(p.title)}</h1><p class=sub>{esc(p.subtitle)}</p>
<div id=errors hidden></div>
<p id=verdict class="verdict {p.verdict_class}">{esc(p.verdict)}</p>{notes}<div id=commands>{commands}</div>{bisect}
<div class=stats id=stats>{stats}</div>
{_comparison(p)}
<section id=run><h2>The run</h2>{_timeline(p)}</section>
<section id=requests><h2>Requests</h2><div class=controls><input type=search id=req-filter placeholder="filter by request id or status">
{only}<span id=req-count class=muted></span></div>
<div class=tablewrap><table class=data><thead><tr id=req-head></tr></thead><tbody id=req-body></tbody></table></div>
<button id=req-more hidden>show more</button></section>
<section id=provenance><h2>Provenance</h2><div class=cards>{prov}</div></section>
</main><div id=tip hidden></div>
<script type="application/json" id=report-data>{data}</script>
<script>{SCRIPT}</script></body></html>
"""
