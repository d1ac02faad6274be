"""The report's section for `replay trainer`: its verdict and figures, a histogram of |Δ| by decade, |Δ| by output
position, the worst tokens, MoE router agreement and the bisect's verdict, from the JSON `replay trainer --json`
printed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from replay.errors import UsageError
from replay.report.origin import made_on
from replay.report.page import Bars, Card


def trainer_section(path: str | os.PathLike, capture: str | os.PathLike | None = None) -> tuple[Card, list[Bars]]:
    """The card of facts and the two bar charts; `capture`: the report's, which the JSON must have been made on."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{path}: cannot read a trainer report: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("overall"), dict) or "verdict" not in doc:
        raise UsageError(f"{path}: not a trainer report (the JSON `replay trainer --json` prints has verdict and "
                         "overall)")
    if capture is not None:
        made_on(doc, path, capture, "a trainer report")
    f, units = doc["overall"], doc.get("units", "logprob")
    facts: list[tuple[str, Any]] = [
        ("verdict", doc["verdict"]),
        ("trainer", f"transformers {doc.get('model')} ({doc.get('dtype')}, {doc.get('attention')}, micro-batch "
                    f"{doc.get('micro_batch')}{', packed' if doc.get('pack') else ''})"),
        ("vLLM's numbers", doc.get("logprobs_mode")),
        ("tokens, sequences", f"{f['tokens']}, {f['sequences']}"),
        (f"mean |Δ{units}|, max", f"{f['mean_abs']:.3g}, {f['max_abs']:.3g}"),
    ]
    if f.get("k3") is not None:
        facts += [("k3 KL", f"{f['k3']:.3g}"),
                  (f"clipped at C={f['clip']:g}", f"{f['clipped_tokens']} tokens, {f['clipped_sequences']} "
                                                   "sequences")]
    naive = doc.get("as_trainer")
    if isinstance(naive, dict):
        facts.append(("as a trainer sees it", f"mean |Δ| {naive['mean_abs']:.3g}, max {naive['max_abs']:.3g}, "
                                              f"clipped {naive['clipped_tokens']} tokens"))
    for w in doc.get("worst") or []:
        facts.append(("worst token", f"{w['request']} position {w['position']} (step {w['step']}, a batch of "
                                     f"{w['batch_requests']}): Δ {w['delta']:.3g}"))
    for r in doc.get("requests") or []:
        if r.get("set_aside"):
            facts.append(("set aside", f"{r['request']}: {r['set_aside']}"))
        elif r.get("semantics"):
            facts.append(("semantics", f"{r['request']}: {r['semantics']}"))
    routing = doc.get("routing")
    if isinstance(routing, dict):
        facts.append(("MoE router agreement", ", ".join(f"layer {x['layer']}: {100 * x['fraction']:.3g} %"
                                                         for x in routing["layers"])))
    layers = doc.get("layers")
    if isinstance(layers, dict):
        facts.append(("bisect", layers["verdict"]))
    card = Card("trainer", "The trainer against vLLM", facts,
                {"rounding": int(bool(doc.get("rounding"))), "tokens": f["tokens"]})
    hist = Bars("trainer-histogram", f"|Δ{units}|: tokens per decade",
                [("0" if b["high"] == 0 else f"[{b['low']:.0e}, {b['high']:.0e})", b["tokens"], str(b["tokens"]))
                 for b in doc.get("histogram") or []])
    pos = Bars("trainer-positions", f"mean |Δ{units}| by output position",
               [(str(b["first"]) if b["first"] == b["last"] else f"{b['first']}-{b['last']}", b["mean_abs"],
                 f"{b['mean_abs']:.2g} (max {b['max_abs']:.2g}, {b['tokens']} tokens)")
                for b in doc.get("by_position") or []])
    return card, [hist, pos]
