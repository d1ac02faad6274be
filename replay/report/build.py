"""`write_report`: `replay report`. Reads the run, makes the comparison asked for (a replay of the capture, or a
second recorded run), and writes the page: one self-contained HTML file."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

import msgspec

from replay import __version__
from replay.diff import (
    BatchComposition,
    CaptureDiff,
    Divergence,
    TokenMismatch,
    Tolerance,
    diff_captures,
)
from replay.diff.twins import Twins
from replay.errors import UsageError
from replay.replayer import ReplayOptions, ReplayReport, replay_capture
from replay.replayer.suspects import LORA_SLOTS
from replay.replayer.verdict import replay_verdict
from replay.report.comparison import cell_of, comparison_data
from replay.report.origin import made_on
from replay.report.page import Batch, Card, Page, render_page
from replay.report.pairs import position_mismatches
from replay.report.run_facts import RunFacts, run_facts
from replay.report.sections import provenance, request_table, run_stats, steps_data
from replay.report.trainer_section import trainer_section

KEEP_DIVERGENCES = 50_000_000  # a report's replay keeps every divergence (the terminal's keeps 1,000)


class ReportResult(msgspec.Struct):
    """What `replay report` wrote, and the verdict at its top."""

    path: str
    bytes: int
    seconds: float
    comparison: str  # "none" | "replay" | "captures"
    verdict: str
    diverged: bool
    first_divergence: Divergence | TokenMismatch | None = None
    data_lost: list[str] = []


def default_output(capture: str | os.PathLike) -> Path:
    """Where a report goes without -o: beside the capture, `NAME.report.html`."""
    p = Path(capture)
    return p.with_name((p.stem if p.suffix == ".capture" else p.name) + ".report.html")


def write_report(capture: str | os.PathLike, output: str | os.PathLike | None = None, *,
                 replay: ReplayOptions | ReplayReport | None = None, other: str | os.PathLike | None = None,
                 tolerance: Tolerance | None = None, bisect: str | os.PathLike | None = None,
                 explain: str | os.PathLike | None = None, trainer: str | os.PathLike | None = None) -> ReportResult:
    """Write the report of `capture` to `output` (default: `default_output`). With `replay` (options to replay it
    with, every divergence kept, or a replay already made) it shows the replay's comparison; with `other` (a
    second capture of the same workload) the two runs' (`tolerance` as `replay diff` takes it); with `bisect`
    (the JSON `replay bisect ... --json` printed) that verdict too, and with `explain` (the JSON `replay explain
    --json` printed) the class and its evidence, and with `trainer` (the JSON `replay trainer --json` printed) its
    figures, a histogram of |Δ| and |Δ| by position."""
    start = time.perf_counter()
    if replay is not None and other is not None:
        raise UsageError("a report compares the capture with a replay (--diff) or with a second capture, not both")
    if tolerance is not None and other is None:  # a replay's tolerance is its ReplayOptions'; nothing else judges
        raise UsageError("a tolerance judges a second capture's logprobs (other=...); a replay takes its own from "
                         "ReplayOptions(tolerance=...)")
    bisect_card = _bisect_card(bisect, capture) if bisect is not None else None  # a bad file before a long replay
    explain_card = _explain_card(explain, capture) if explain is not None else None
    trainer_card, trainer_bars = trainer_section(trainer, capture) if trainer is not None else (None, [])
    out = Path(output) if output is not None else default_output(capture)
    run = run_facts(capture)
    if isinstance(replay, ReplayOptions):
        replay = replay_capture(capture, dataclasses.replace(replay, max_divergences=KEEP_DIVERGENCES))
    if replay is not None:
        page, first, lost = _replay_page(run, replay), replay.first_divergence, replay.data_lost
        kind, verdict, diverged = "replay", replay.verdict or replay_verdict(replay), replay.diverged
    elif other is not None:
        res = diff_captures(capture, other, tolerance or Tolerance())
        page, first, lost = _captures_page(run, res, tolerance or Tolerance()), res.first_divergence, []
        kind, verdict, diverged = "captures", res.verdict, res.diverged
    else:
        page, first, lost, kind, diverged = _run_page(run), None, [], "none", False
        verdict = page.verdict
    page.bisect, page.explain = bisect_card, explain_card
    page.trainer, page.trainer_bars = trainer_card, trainer_bars
    lost = lost or [d.describe() for d in run.damage]
    text = render_page(page)
    tmp = out.with_name(out.name + ".partial")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as e:
        raise UsageError(f"{out}: cannot write: {e.strerror or e}") from None
    return ReportResult(str(out), len(text.encode()), round(time.perf_counter() - start, 3), kind, verdict, diverged,
                        first, lost)


def _page(run: RunFacts, verdict: str, cls: str, **kw: Any) -> Page:
    """A page with the run's sections filled in."""
    created = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    kw.setdefault("subtitle", f"{run.path} · report written {created} by replay {__version__}")
    data = {"steps": steps_data(run), "requests": request_table(run, kw.pop("per_request", None)),
            "comparison": kw.pop("comparison", None)}
    return Page(title=f"replay report: {Path(run.path).name}", verdict=verdict, verdict_class=cls,
                stats=run_stats(run), provenance=provenance(run.header, run.status), data=data, **kw)


def _run_page(run: RunFacts) -> Page:
    tokens = sum(f.tokens for f in run.requests.values())
    sentence = (f"The run as recorded: {len(run.index):,} steps, {len(run.requests):,} requests, {tokens:,} generated "
                f"tokens (capture {run.status}). No comparison: --diff adds a replay's.")
    notes = [f"damaged: {d.describe()}" for d in run.damage]
    return _page(run, sentence, "none", notes=notes, commands=[
        ("replay it and compare, in the terminal", f"replay run {shlex.quote(run.path)} --diff"),
        ("... or as this report", f"replay report {shlex.quote(run.path)} --diff")])


def _commands(rep: ReplayReport) -> list[tuple[str, str]]:
    """The re-run of the first divergent step, and the whole comparison, in the terminal and as this report."""
    whole = shlex.split(rep.rerun)
    out = [("the whole comparison in the terminal", rep.rerun), ("this report", shlex.join(["replay", "report",
                                                                                           *whole[2:]]))]
    return out if rep.repro is None else [("re-run the first divergent step", rep.repro), *out]


def _replay_page(run: RunFacts, rep: ReplayReport) -> Page:
    tol = rep.tolerance
    how = "bitwise" if tol.bitwise else f"atol {tol.atol:g}, rtol {tol.rtol:g}"
    notes = [f"note: {d}" for d in rep.environment_differences]
    notes += [f"provenance (cannot change numerics by itself): {d}" for d in rep.host_differences]
    notes += [f"ignored (--force): {what}" for what in rep.ignored]
    notes += [f"tolerance auto: {rep.tolerance_choice}"] * bool(rep.tolerance_choice)
    differ = "" if rep.suspect == rep.unknown or rep.suspect.startswith(LORA_SLOTS) else \
        " (the recording and the replay differ there)"
    notes += [f"suspect: {rep.suspect}{differ}"] * bool(rep.suspect)
    notes += [f"capture damaged ({'; '.join(rep.data_lost[:3])})"] * bool(rep.data_lost)
    shown = len(rep.divergences)
    text = (f"The recording against a replay of it ({rep.mode} mode, {how}): {rep.steps_compared:,} steps, "
            f"{rep.requests_compared:,} requests and {rep.tokens_compared:,} sampled tokens compared, "
            f"{rep.num_divergences:,} divergences" + (f" (the plots show the first {shown:,})"
                                                      if shown < rep.num_divergences else "") + ".")
    cards, data, batches, per_request = [], None, [], None
    if rep.first_divergence is not None:
        data = comparison_data(run, rep.divergences, None, tol)
        per_request = data.pop("per_request")
        first, flip = rep.first_divergence, rep.first_token_flip
        cards.append(_divergence_card("first-divergence", "First divergence", first))
        data.update(_marks(run, first, flip), equal_label="equal (bitwise)" if tol.bitwise else f"equal within {how}")
        if flip is not None:
            cards.append(_divergence_card("first-flip", "First token flip", flip))
        if rep.batch is not None:
            batches.append(_batch(rep.batch, first, rep.divergences))
    legend = _legend(data)
    return _page(run, rep.verdict or replay_verdict(rep), "diverged" if rep.diverged else "match", notes=notes,
                 commands=_commands(rep), cards=cards, batches=batches, comparison_text=text, legend=legend,
                 comparison=data, per_request=per_request)


def _captures_page(run: RunFacts, res: CaptureDiff, tol: Tolerance) -> Page:
    notes = [f"note: {c}" for c in res.config_differences]
    if res.aligned_by_prompt:
        notes.append("note: the runs share no request id: requests aligned by prompt and arrival order, named as in A")
    if res.draws_differ:
        notes.append(f"note: {res.draws_differ} unseeded random request(s) drew another token from the same logprobs: "
                     "compared up to that draw")
    if res.only_in_a or res.only_in_b:
        notes.append(f"not in both: {len(res.only_in_a)} only in A, {len(res.only_in_b)} only in B")
    opts = [] if tol.bitwise else ["--atol", f"{tol.atol:g}", "--rtol", f"{tol.rtol:g}"]
    commands = [("the comparison in the terminal", shlex.join(["replay", "diff", res.a, res.b, *opts])),
                ("the first step where they part", shlex.join(["replay", "bisect", "steps", res.a, res.b, *opts])),
                ("this report", shlex.join(["replay", "report", res.a, res.b, *opts]))]
    text = (f"Two recorded runs, A ({res.a}) and B ({res.b}), request by request: {res.requests_compared:,} requests "
            f"compared, {res.requests_diverged:,} differ. Steps and the heat map's columns are A's; a request is "
            "compared up to its first token flip.")
    cards, data, batches, per_request = [], None, [], None
    d = res.first_divergence
    if d is not None:
        divs, flipped = position_mismatches(res.a, res.b, tol)
        data = comparison_data(run, divs, flipped, tol)
        per_request = data.pop("per_request")
        notes.append(f"suspect: {d.suspect}; the batches {'DIFFER' if d.batches_differ else 'are the same'}")
        first = next((x for x in divs if x.request_id == d.request_id and x.position == d.position), None)
        flip = next((x for x in divs if x.kind in ("token", "length")), None)
        cards.append(Card("first-divergence", "First divergence", [
            ("request", d.request_id), ("token" if d.kind == "routed_experts" else "output position", d.position),
            ("what", _what_parts(d)), ("step in A", d.a_step),
            ("step in B", d.b_step), ("token in A", d.a_token), ("token in B", d.b_token),
            ("rank", None if d.a_rank is None else f"{d.a_rank} → {d.b_rank}"),
            ("max |Δlogprob|", _g(d.max_abs_logprob_diff)), ("top1-top2 margin", _g(d.margin)), ("flip", d.flip),
            ("MoE layer", d.moe_layer), ("experts in A", d.a_experts), ("experts in B", d.b_experts),
            ("suspect", d.suspect)], {"step": d.a_step, "request": d.request_id, "position": d.position,
                                      "kind": d.kind}))
        data.update(_marks(run, first, flip), equal_label="equal (bitwise)" if tol.bitwise else
                    f"equal within atol {tol.atol:g}, rtol {tol.rtol:g}")
        if flip is not None:
            cards.append(_divergence_card("first-flip", "First token flip", flip, ("A", "B")))
        for side, b in (("A", d.a_batch), ("B", d.b_batch)):
            if b is not None:  # (the divergences are placed at A's steps: B's batch marks the first one alone)
                batches.append(_batch(b, first, divs if side == "A" else [], side))
    return _page(run, res.verdict, "diverged" if res.diverged else "match", notes=notes,
                 commands=commands, cards=cards, batches=batches, comparison_text=text,
                 legend=_legend(data), comparison=data, per_request=per_request,
                 subtitle=f"A: {res.a} · B: {res.b} · written by replay {__version__}")


def _what_parts(d) -> str:
    """How two runs part at their first divergence, in the terminal's words."""
    if d.kind == "logprobs":
        return "same token, " + ("top-k ids or order changed, " if d.topk_changed else "") + "logprobs differ"
    return {"token": "token flip", "length": "one side generated more tokens",
            "routed_experts": "an MoE layer routed a token to other experts"}.get(d.kind, d.kind)


def _g(x: float | None) -> str | None:
    return None if x is None else f"{x:.4g}"


def _divergence_card(id_: str, title: str, d: Divergence, sides: tuple[str, str] = ("recorded", "replayed")) -> Card:
    what = {"token": f"token flip ({d.flip})" if d.flip else "token flip", "logprobs": "same token, logprobs differ",
            "prompt_logprobs": "prompt logprobs differ", "missing": "the replay did not run this request",
            "routed_experts": "an MoE layer routed a token to other experts",
            "length": "one side generated more tokens",
            "drafts": "another number of drafts accepted (one side emitted fewer tokens)"}.get(d.kind, d.kind)
    facts = [("step", d.step), ("request", d.request_id), ("output position", d.position), ("what", what),
             (f"token {sides[0]}", d.expected_token), (f"token {sides[1]}", d.actual_token),
             ("rank", None if d.expected_rank is None else f"{d.expected_rank} → {d.actual_rank}"),
             ("max |Δlogprob|", _g(d.max_abs_logprob_diff)), ("sampled-token Δ", _g(d.sampled_logprob_diff)),
             ("top1-top2 margin", _g(d.margin)), ("top-k set changed", "yes" if d.topk_changed else None),
             ("token", d.token_index), ("MoE layer", d.moe_layer), (f"experts {sides[0]}", d.expected_experts),
             (f"experts {sides[1]}", d.actual_experts)]
    return Card(id_, title, [(k, v) for k, v in facts if v is not None],
                {"step": d.step, "request": d.request_id, "position": d.position, "kind": d.kind})


def _marks(run: RunFacts, first: Divergence | None, flip: Divergence | None) -> dict[str, Any]:
    """Where the heat map annotates the first divergence and the first token flip."""
    out: dict[str, Any] = {}
    for key, d, what in (("first", first, "first divergence"), ("first_flip", flip, "first token flip")):
        if d is not None:
            out[f"{key}_cell"] = cell_of(run, d.step, d.internal_id)
            out[f"{key}_label"] = f"{what}: step {d.step}, {d.request_id}, position {d.position}"
    return out


def _batch(b: BatchComposition, first: Divergence | None, divs: list[Divergence], side: str = "") -> Batch:
    """The batch of a step, its diverging requests marked (on B's side of two runs: the first divergence's alone)."""
    bad = {d.request_id for d in divs if d.step == b.step}
    if side == "B" and first is not None:
        bad = {first.request_id} & set(b.num_scheduled_tokens)
    marks = {r: "first" if first is not None and r == first.request_id else "diverged" for r in bad}
    there = "the first divergence's request marked" if side == "B" else f"diverging there: {len(bad)}"
    title = (f"{side + ': ' if side else ''}step {b.step}: {b.num_requests} requests, {b.num_tokens} tokens "
             f"({b.num_prefill} prefill, {b.num_decode} decode); {there}")
    return Batch(title, dict(b.num_scheduled_tokens), marks)


def _legend(data: dict | None) -> dict:
    if data is None:
        return {}
    hm = data["heatmap"]
    return {"lo": hm["lo"], "hi": hm["hi"], "equal": data.get("equal_label", "equal"),
            "not_compared": hm["not_compared"], "atol": hm.get("atol", 0.0)}


def _explain_card(path: str | os.PathLike, capture: str | os.PathLike) -> Card:
    """`replay explain`'s class, verdict, evidence and command, from the JSON it printed (`--json`)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{path}: cannot read an explanation: {getattr(e, 'strerror', None) or e}") from None
    groups: list[Twins] = []
    if isinstance(doc, dict) and "groups" in doc and "explanation" in doc:  # `--pairs --json`: the first group's
        if doc["explanation"] is None:
            raise UsageError(f"{path}: `explain --pairs` found no twins that answered differently: nothing to show")
        try:
            groups = msgspec.convert(doc["groups"], list[Twins])
        except msgspec.ValidationError as e:
            raise UsageError(f"{path}: `explain --pairs` JSON with unreadable groups: {e}") from None
        doc = doc["explanation"]
    if not isinstance(doc, dict) or not isinstance(doc.get("found"), str) or not isinstance(doc.get("verdict"), str):
        raise UsageError(f"{path}: not an explanation (the JSON `replay explain --json` prints has found and verdict)")
    made_on(doc, path, capture, "an explanation")
    facts: list[tuple[str, Any]] = [("class", doc["found"]), ("a bug", "yes" if doc.get("bug") else "no"),
                                    ("verdict", doc["verdict"])]
    facts += [("twins", g.describe()) for g in groups]  # (every group --pairs found; the verdict is the first's)
    facts += [("evidence", e) for e in doc.get("evidence") or [] if isinstance(e, str)]
    leak = doc.get("leak")
    if isinstance(leak, dict) and leak.get("minimal_set"):
        facts.append(("neighbours whose content moves it", ", ".join(map(str, leak["minimal_set"]))))
        if leak.get("first_module"):
            facts.append(("first module", leak["first_module"]))
    for key in ("command", "re_executions", "runner"):
        if doc.get(key) not in (None, ""):
            facts.append(({"command": "reproduce", "re_executions": "replays"}.get(key, key), doc[key]))
    facts += [("note", n) for n in doc.get("notes") or [] if isinstance(n, str)]
    return Card("explain", "Bug or noise", facts, {"found": doc["found"], "bug": int(bool(doc.get("bug")))})


def _bisect_card(path: str | os.PathLike, capture: str | os.PathLike) -> Card:
    """A bisect's verdict and its scalar facts, from the JSON `replay bisect ... --json` printed."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{path}: cannot read a bisect result: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("verdict"), str):
        raise UsageError(f"{path}: not a bisect result (the JSON `replay bisect ... --json` prints has a verdict)")
    made_on(doc, path, capture, "a bisect")
    facts: list[tuple[str, Any]] = [("verdict", doc["verdict"])]
    for k, v in doc.items():
        if k == "verdict" or v is None:
            continue
        if isinstance(v, (str, int, float, bool)):
            facts.append((k.replace("_", " "), v))
        elif isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v):
            facts.append((k.replace("_", " "), ", ".join(map(str, v[:20])) + (" ..." if len(v) > 20 else "")))
        elif isinstance(v, dict) and isinstance(v.get("first_divergence"), dict):
            f = v["first_divergence"]
            facts.append((f"{k}: first divergence", f"step {f.get('step', f.get('a_step'))}, request "
                                                     f"{f.get('request_id')}, position {f.get('position')}"))
        elif isinstance(v, dict) and all(isinstance(x, (str, int, float, bool)) for x in v.values()):
            facts.append((k.replace("_", " "), ", ".join(f"{a}={b}" for a, b in v.items())))
    return Card("bisect", "Bisect", facts, {"verdict": doc["verdict"]})
