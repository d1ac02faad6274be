"""Rendering `replay explain`: the class and its evidence, or the groups of twins that answered differently."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replay.bisect.explain_divergence import DivergenceExplanation
    from replay.bisect.explain_pair import PairExplanation
    from replay.diff.twins import Twins


def render_twins(groups: list[Twins], compared: int | None = None) -> str:
    """`explain --pairs`: every group of identical requests whose outputs differ, of `compared` groups."""
    if not groups and compared == 0:
        return "no two requests share a prompt and sampling (greedy, or one seed): no twins to compare"
    if not groups:
        return ("no two requests with the same prompt and sampling answered differently" +
                (f" ({compared} group(s) of twins compared)" if compared is not None else ""))
    lines = [f"{len(groups)} group(s) of requests with the same prompt and sampling answered differently" +
             (f" (of {compared} compared):" if compared is not None else ":")]
    lines.extend(f"  {g.describe()}" for g in groups)
    return "\n".join(lines)


def render_pair(res: PairExplanation) -> str:
    """`explain --pair A B`: the verdict, then the evidence in the order it was gathered."""
    lines = [res.verdict]
    if res.position is not None:
        lines.append(f"  parted at output position {res.position} ({res.kind}), computed at steps {res.step_a} "
                     f"({res.a}) and {res.step_b} ({res.b})" +
                     (f"; top1-top2 margin there {res.margin:.3g}" if res.margin is not None else ""))
    if res.alone_equal is not None:
        lines.append(f"  alone: {'bitwise equal' if res.alone_equal else 'differ'}" +
                     (f" (max |Δlogit| {res.alone_max_abs_logit_diff:.3g})" if not res.alone_equal else "") +
                     (f"; recorded: max |Δlogprob| {res.recorded_max_abs_logprob_diff:.3g}"
                      if res.recorded_max_abs_logprob_diff is not None else ""))
    if res.leak is not None:
        lines.append(f"  swap: {res.leak.verdict}")
    if res.knob:
        lines.append(f"  the knob: {res.knob}")
    if res.command:
        lines.append(f"  reproduce: {res.command}")
    if res.re_executions:  # (twins that agree as recorded need none)
        on = " on vLLM's runner, one engine" if res.runner == "vllm" else ""
        lines.append(f"  {res.re_executions} replays{on}")
    return "\n".join(lines + [f"  note: {n}" for n in res.notes])


def render_divergence(res: DivergenceExplanation) -> str:
    """`explain CAPTURE`: the class and verdict, the evidence, and the command that reproduces it."""
    lines = [res.verdict, *[f"  evidence: {e}" for e in res.evidence if e not in res.verdict]]
    if res.command:
        lines.append(f"  reproduce: {res.command}")
    lines.append(f"  {res.re_executions} replays" + (" on vLLM's runner" if res.runner == "vllm" else ""))
    if res.data_lost:
        lines.append(f"  capture damaged ({'; '.join(res.data_lost[:3])}): only its readable prefix was replayed")
    return "\n".join(lines + [f"  note: {n}" for n in res.notes if n not in res.verdict and n not in res.evidence])
