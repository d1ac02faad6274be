"""How `replay trainer`'s answer reads."""

from __future__ import annotations

from replay.trainer import TrainerReport
from replay.trainer.figures import Figures
from replay.trainer.layers import TrainerLayers


def _figures(f: Figures, unit: str = "Δ") -> str:
    k3 = f", k3 KL {f.k3:.3g}" if f.k3 is not None else ""
    clip = (f", a clip at C={f.clip:g} touches {f.clipped_tokens} token(s) in {f.clipped_sequences} sequence(s)"
            if f.k3 is not None else "")
    return (f"{f.tokens} tokens of {f.sequences} sequence(s): mean |{unit}| {f.mean_abs:.3g}, max {f.max_abs:.3g}"
            f"{k3}{clip}")


def render_trainer(r: TrainerReport) -> str:
    """The verdict, the figures, Δ by position, the worst tokens, what was set aside and why."""
    lines = [r.verdict,
             f"  trainer: transformers {r.model} ({r.dtype}, {r.attention}, micro-batch {r.micro_batch}"
             f"{', packed' if r.pack else ''}{'' if r.device == 'cpu' else f', on {r.device}'}); vLLM's numbers: "
             f"{r.logprobs_mode}"]
    lines.append("  like for like:      " + _figures(r.overall, f"Δ{r.units}"))
    if r.as_trainer is not None:
        lines.append("  as a trainer sees:  " + _figures(r.as_trainer, "Δlogprob")
                     + " (whole-vocabulary log_softmax(logits/T) against vLLM's numbers)")
    if r.by_position:
        lines.append("  |Δ| by position:    " + ", ".join(
            f"{b.first}{'' if b.last == b.first else f'-{b.last}'}: {b.mean_abs:.2g} (max {b.max_abs:.2g})"
            for b in r.by_position))
    if r.worst:
        width = max(len("request"), *(len(w.request) for w in r.worst))
        lines.append(f"  {'request':<{width}} {'pos':>4} {'step':>5} {'batch':>14} {'token':>7} {'trainer':>12} "
                     f"{'vLLM':>12} {'Δ':>9}")
        for w in r.worst:
            batch = f"{w.batch_requests} req/{w.batch_tokens} tok"
            lines.append(f"  {w.request:<{width}} {w.position:>4} {w.step:>5} {batch:>14} {w.token:>7} "
                         f"{w.trainer:>12.6f} {w.vllm:>12.6f} {w.delta:>9.2g}")
    for s in r.requests:
        if s.set_aside:
            lines.append(f"  set aside: {s.request}: {s.set_aside}")
    alike: dict[str, list] = {}  # one line for the sequences sampled alike (an RL batch: all of them)
    for s in r.requests:
        if s.semantics:
            alike.setdefault(s.semantics, []).append(s)
    for meaning, group in alike.items():
        names = ", ".join(s.request for s in group[:3]) + (f" and {len(group) - 3} more" if len(group) > 3 else "")
        widest = max(s.semantic_gap for s in group)
        gap = f" (the gap, not counted: max {widest:.3g})" if widest else ""
        lines.append(f"  semantics: {names}: {meaning}{gap}")
    lines += [f"  note: {n}" for n in r.notes]
    if r.data_lost:
        lines.append(f"  capture damaged ({'; '.join(r.data_lost[:3])}): the sequences it cut are scored up to "
                     "where it lost data")
    if r.routing is not None:
        g = r.routing
        lines.append(f"  MoE routing: {g.tokens} tokens; the trainer's router picks vLLM's experts in " + ", ".join(
            f"layer {x.layer}: {100 * x.fraction:.3g} %" for x in g.layers))
        if g.first is not None:
            f = g.first
            lines.append(f"    first routed otherwise in MoE layer {f.layer}: request {f.request}, token "
                         f"{f.token_index}: vLLM {f.vllm}, the trainer {f.trainer}")
    if r.layers is not None:
        lines.append(render_layers(r.layers))
    return "\n".join(lines)


def render_layers(t: TrainerLayers) -> str:
    """The bisect's verdict and its module table, replay side against the trainer's."""
    width = max(len(m.module) for m in t.modules) + 2
    lines = [t.verdict, f"  {'module':<{width}} {'max |Δ|':>10} {'relative':>10} {'ULPs':>10}  {t.other}'s"]
    for m in t.modules:
        mark = "  <- beyond" if m.module == t.first_module else ""
        mine = "" if m.trainer == m.module.removeprefix("model.") else m.trainer
        row = f"  {m.module:<{width}} {m.max_abs:>10.3g} {m.relative:>10.3g} {m.max_ulps:>10.3g}  {mine}{mark}"
        lines.append(row.rstrip())
    if t.unmatched:
        lines.append(f"  ({t.unmatched} module(s) of the replay have no counterpart on {t.other}'s side)")
    lines += [f"  note: {n}" for n in t.notes]
    if t.dump:
        lines.append(f"  dumped to {t.dump}")
    return "\n".join(lines)
