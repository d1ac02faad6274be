"""Human-readable rendering of library results. Plain text (no colour codes) so output pipes and diffs cleanly."""

from __future__ import annotations

import datetime as dt


from replay.capture import Damage, Step
from replay.capture.recover import RecoverResult
from replay.show import ShownSteps
from replay.summary import CaptureInfo


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB" if n >= 100_000 else f"{n:,} B"


def render_damage(damage: list[Damage]) -> list[str]:
    """One line per damage entry."""
    return [f"  - {d.kind}: {d.describe()}" for d in damage]


def render_info(info: CaptureInfo) -> str:
    """`replay info` as aligned label/value lines."""
    h = info.header
    created = dt.datetime.fromtimestamp(h.created, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [
        f"capture   {info.path}",
        f"format    {info.format_version} ({'complete' if info.complete else 'UNFINISHED: no seek index'}), "
        f"written by replay {h.tool_version} on {created}",
        f"status    {info.status}",
        f"engine    {h.engine}{' ' + h.engine_version if h.engine_version else ''}",
    ]
    if h.model is not None:
        m = h.model
        fp = f" fingerprint {m.fingerprint[:16]}" if m.fingerprint else ""
        lines.append(f"model     {m.name} {m.architecture} {m.dtype}{fp}".rstrip())
    c = h.engine_config
    cfg = [f"block size {c.block_size}"]
    if c.num_gpu_blocks:
        cfg.append(f"{c.num_gpu_blocks} KV blocks")
    if c.max_num_seqs:
        cfg.append(f"max seqs {c.max_num_seqs}")
    if c.max_num_batched_tokens:
        cfg.append(f"max batched tokens {c.max_num_batched_tokens}")
    cfg.append(f"prefix caching {'on' if c.enable_prefix_caching else 'off'}")
    cfg.append(f"chunked prefill {'on' if c.enable_chunked_prefill else 'off'}")
    if c.attention_impl:
        cfg.append(f"attention {c.attention_impl}")
    if c.seed is not None:
        cfg.append(f"seed {c.seed}")
    lines.append("config    " + ", ".join(cfg))
    e = h.environment
    env = [e.device or "?"]
    if e.torch_version:
        env.append(f"torch {e.torch_version}")
    if e.num_threads:
        env.append(f"{e.num_threads} threads")
    env.append(f"python {e.python_version}" if e.python_version else "")
    lines.append("env       " + ", ".join(x for x in env if x))
    span = f" ({info.first_step}-{info.last_step})" if info.first_step is not None else ""
    lines += [
        f"steps     {info.num_steps:,}{span} in {info.num_chunks} chunks",
        f"requests  {info.num_requests:,} scheduled, {info.num_requests_added:,} arrivals recorded",
        f"tokens    {info.num_scheduled_tokens:,} scheduled, {info.num_generated_tokens:,} generated",
    ]
    bpt = f", {info.bytes_per_generated_token} B per generated token" if info.bytes_per_generated_token else ""
    lines.append(f"size      {_mb(info.file_bytes)} on disk, {_mb(info.raw_bytes)} raw, ratio {info.compression_ratio:.2f}x{bpt}")
    if info.unknown_records:
        lines.append(f"skipped   {info.unknown_records} records of a newer format version")
    if info.damage:
        lines.append(f"damage    {len(info.damage)} problem(s); data was lost:")
        lines += render_damage(info.damage)
    else:
        lines.append("damage    none")
    return "\n".join(lines)


def _lp_cells(step: Step, row: int) -> tuple[str, str, str]:
    lp = step.model_runner_output.logprobs if step.model_runner_output is not None else None
    if lp is None or row >= lp.num_rows:
        return "", "", ""
    ids = lp.logprob_token_ids.to_numpy()[row]
    vals = lp.logprobs.to_numpy()[row]
    rank = int(lp.sampled_token_ranks.to_numpy()[row])
    topk = " ".join(f"{int(t)}:{float(v):.4g}" for t, v in zip(ids[1:], vals[1:]))
    return f"{float(vals[0]):.6g}", str(rank), topk


def render_step(step: Step, external_ids: dict[str, str], only: str | None = None) -> str:
    """One step: batch composition, then a row per scheduled request."""
    so, mro = step.scheduler_output, step.model_runner_output
    new_ids = {r.req_id: r for r in so.scheduled_new_reqs}
    cr = so.scheduled_cached_reqs
    cached = {rid: i for i, rid in enumerate(cr.req_ids)}
    prefill = sum(1 for rid, n in so.num_scheduled_tokens.items() if rid in new_ids or n > 1)
    decode = len(so.num_scheduled_tokens) - prefill
    head = (f"step {step.index}: {len(so.num_scheduled_tokens)} requests, {so.total_num_scheduled_tokens} tokens "
            f"({prefill} prefill, {decode} decode); {len(new_ids)} new, {len(cr.resumed_req_ids)} resumed, "
            f"{len(so.finished_req_ids)} finished before it")
    if step.timing is not None and step.timing.execute_ns:
        head += f"; execute {step.timing.execute_ns / 1e6:.2f} ms"
    rows = [head, f"  {'request':<44} {'kind':<8} {'computed':>8} {'sched':>6}  {'sampled':<12} {'logprob':>10} {'rank':>5}  top-k"]
    index = mro.req_id_to_index if mro is not None else {}
    for rid, n in so.num_scheduled_tokens.items():
        if only is not None and rid != only:
            continue
        if rid in new_ids:
            kind, computed = "new", new_ids[rid].num_computed_tokens
        else:
            i = cached.get(rid)
            kind = "resumed" if rid in cr.resumed_req_ids else "cached"
            computed = cr.num_computed_tokens[i] if i is not None else -1
        label = rid + (f" ({external_ids[rid]})" if rid in external_ids else "")
        row = index.get(rid)
        sampled = str(mro.sampled_token_ids[row]) if mro is not None and row is not None and row < len(mro.sampled_token_ids) else "-"
        lpv, rank, topk = _lp_cells(step, row) if row is not None else ("", "", "")
        rows.append(f"  {label:<44} {kind:<8} {computed:>8} {n:>6}  {sampled:<12} {lpv:>10} {rank:>5}  {topk}")
    if so.finished_req_ids and only is None:
        rows.append("  finished: " + ", ".join(sorted(so.finished_req_ids)))
    return "\n".join(rows)


def render_shown(shown: ShownSteps) -> str:
    """`replay show`."""
    parts = [render_step(s, shown.external_ids, shown.request) for s in shown.steps]
    if shown.damage:
        parts.append("damage (data was lost):\n" + "\n".join(render_damage(shown.damage)))
    return "\n\n".join(parts)


def render_recover(res: RecoverResult) -> str:
    """`replay recover`."""
    lines = [f"recovered {res.num_steps:,} steps ({res.num_records:,} records) from {res.source} into {res.output}"]
    if res.damage:
        lines.append("lost:")
        lines += render_damage(res.damage)
    if res.unknown_records_dropped:
        lines.append(f"dropped {res.unknown_records_dropped} records of a newer format version (this replay cannot re-encode them)")
    if not res.lost_data:
        lines.append("nothing was lost")
    return "\n".join(lines)


__all__ = ["render_info", "render_shown", "render_step", "render_recover", "render_damage"]


def _batch_line(b) -> str:
    ids = ", ".join(b.request_ids[:12]) + (f", ... ({len(b.request_ids)} in all)" if len(b.request_ids) > 12 else "")
    return (f"step {b.step}: {b.num_requests} requests, {b.num_tokens} tokens ({b.num_prefill} prefill, "
            f"{b.num_decode} decode): {ids}")


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def render_divergence(d) -> list[str]:
    """The lines that describe one divergence."""
    if d.kind == "token":
        margin = f"top1-top2 margin {_fmt(d.margin, '.4g')}" if d.margin is not None else "margin unknown (no top-2 logprobs)"
        return [f"  step {d.step}, request {d.request_id}, output position {d.position}: token {d.expected_token} "
                f"expected, {d.actual_token} replayed ({(d.flip or '').upper()} FLIP)",
                f"  rank {d.expected_rank} -> {d.actual_rank}, max |Δlogprob| {_fmt(d.max_abs_logprob_diff)}, {margin}"]
    if d.kind == "missing":
        return [f"  step {d.step}, request {d.request_id}: the replay did not run this request"]
    what = "prompt logprobs" if d.kind == "prompt_logprobs" else "logprobs"
    extra = f", sampled-token Δ {_fmt(d.sampled_logprob_diff)}" if d.sampled_logprob_diff is not None else ""
    topk = ", top-k set changed" if d.topk_changed else ""
    return [f"  step {d.step}, request {d.request_id}, output position {d.position}: same token {d.expected_token}, "
            f"{what} differ: max |Δlogprob| {_fmt(d.max_abs_logprob_diff)}{extra}{topk}"]


def render_replay(rep) -> str:
    """`replay run --diff`: verdict, first divergence with its batch, the repro command, then a per-step table."""
    tol = rep.tolerance
    tol_text = "bitwise" if tol.bitwise else f"atol {tol.atol:g}, rtol {tol.rtol:g}"
    lines = []
    for d in rep.environment_differences:
        lines.append(f"note: {d}")
    head = (f"replayed {rep.steps_replayed} steps of {rep.capture} ({rep.mode} mode, {tol_text}; a tie flip is a "
            f"flip at a top1-top2 margin < {tol.tie_margin:g} or within 2x the logprob noise at that position)")
    lines.append(head)
    if rep.plant is not None:
        p = rep.plant
        lines.append(f"planted: {p.size:g} added to {p.module} for request {p.request} at step {p.step}")
    if rep.run_to_run:
        lines.append(f"run to run: {rep.run_to_run}")
    if rep.foreign_draws_differ:
        lines.append(f"note: {rep.foreign_draws_differ} sampled token(s) of random-sampling requests differ and are "
                     "not compared: vLLM drew them with its own sampler kernels and random streams, which only "
                     "vLLM's runner repeats (--set runner=vllm); their logprobs are compared")
    if not rep.diverged:
        lines.append("MATCH: every replayed step equals the recording")
        return "\n".join(lines)
    tokens = sum(s.token_mismatches for s in rep.steps)
    lines.append(f"DIVERGED: {rep.num_divergences} divergence(s), {tokens} token flip(s), first at step "
                 f"{rep.first_divergence.step}")
    lines += render_divergence(rep.first_divergence)
    if rep.batch is not None:
        lines.append("  batch: " + _batch_line(rep.batch))
    lines.append(f"  re-run: {rep.repro}")
    flip = rep.first_token_flip
    if flip is not None and flip is not rep.first_divergence:
        lines.append("first token flip:")
        lines += render_divergence(flip)
    bad = [s for s in rep.steps if s.token_mismatches or s.logprob_mismatches]
    lines.append("")
    lines.append(f"{'step':>6} {'reqs':>5} {'tokens':>7} {'token flips':>12} {'logprob diffs':>14} {'max |Δlogprob|':>15} "
                 f"{'top-k changes':>14} {'rank changes':>13}")
    for s in bad[:40]:
        lines.append(f"{s.step:>6} {s.num_requests:>5} {s.num_tokens:>7} {s.token_mismatches:>12} {s.logprob_mismatches:>14} "
                     f"{s.max_abs_logprob_diff:>15.3g} {s.topk_set_changes:>14} {s.rank_changes:>13}")
    if len(bad) > 40:
        lines.append(f"... {len(bad) - 40} more steps differ (--json has every number)")
    lines.append(f"{len(bad)} of {len(rep.steps)} steps differ")
    return "\n".join(lines)


def render_capture_diff(res) -> str:
    """`replay diff A B`."""
    lines = [f"compared {res.requests_compared} requests of {res.a} (A) and {res.b} (B)"]
    for c in res.config_differences:
        lines.append(f"note: {c}")
    if res.only_in_a or res.only_in_b:
        lines.append(f"not in both: {len(res.only_in_a)} only in A, {len(res.only_in_b)} only in B")
    d = res.first_divergence
    if d is None:
        lines.append("MATCH: every common request produced the same tokens and logprobs")
        return "\n".join(lines)
    lines.append(f"DIVERGED: {res.requests_diverged} request(s) differ; first: request {d.request_id}, output position "
                 f"{d.position}")
    if d.kind == "token":
        lines.append(f"  token {d.a_token} in A, {d.b_token} in B ({(d.flip or '').upper()} FLIP, top1-top2 margin "
                     f"{_fmt(d.margin, '.4g')}, max |Δlogprob| {_fmt(d.max_abs_logprob_diff)})")
    elif d.kind == "logprobs":
        lines.append(f"  same token {d.a_token}; logprobs differ by up to {_fmt(d.max_abs_logprob_diff)}")
    else:
        lines.append("  one side generated more tokens than the other")
    if d.a_batch is not None:
        lines.append("  A " + _batch_line(d.a_batch))
    if d.b_batch is not None:
        lines.append("  B " + _batch_line(d.b_batch))
    lines.append(f"  batches {'DIFFER' if d.batches_differ else 'are the same'}: suspect {d.suspect}")
    return "\n".join(lines)
