"""`replay_capture`: re-execute a capture's steps on a fresh runner and diff them against the recording.

Modes, named as vLLM names them:
- `forced` (default; vLLM's "trace replay"): before each step the runner's cached sampled tokens are overwritten
  with the recorded ones, so every step runs on the recorded trajectory and each step's diff is local;
- `free`: the runner keeps its own samples, which shows how far a divergence propagates.

The recorded `SchedulerOutput`s are a diff against the runner's state, so replay starts from an empty runner at
step 0 and applies every step in order (a prefix `--steps 0-B` stops early).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import sys
import time
from dataclasses import dataclass, field

import msgspec

from replay.capture import CaptureReader, RequestAdded, Step
from replay.capture import format as fmt
from replay.contracts import SAMPLING_EPS
from replay.diff import BatchComposition, Divergence, StepSummary, Tolerance, batch_composition, compare_step
from replay.errors import EXIT_DIVERGED, ReplayError, UsageError
from replay.plant import Plant, install
from replay.runners import build_runner
from replay.show import StepRange

MODES = ("forced", "free")


class DivergenceFound(ReplayError):
    """The replay (or the other capture) differs beyond tolerance; exit code 1."""

    exit_code = EXIT_DIVERGED


@dataclass(slots=True)
class ReplayOptions:
    """How to replay."""

    mode: str = "forced"
    overrides: dict[str, str] = field(default_factory=dict)  # --set KNOB=VALUE
    steps: str | None = None  # "A-B": replay only a prefix (steps before A run but are not diffed)
    tolerance: Tolerance = field(default_factory=Tolerance)
    repeat: int = 1
    force: bool = False  # replay on a different model
    plant: Plant | None = None
    first_token_flip: Divergence | None = None  # the first divergence that changed a token, if any
    diff: bool = True
    progress: bool = False
    max_divergences: int = 1000  # kept in the report (all are counted)


class ReplayReport(msgspec.Struct):
    """What a replay found. JSON always has `diverged` and `first_divergence`."""

    capture: str
    mode: str
    diverged: bool
    first_divergence: Divergence | None
    batch: BatchComposition | None  # the batch of the first divergence's step
    repro: str | None  # the command that re-runs up to that step
    tolerance: Tolerance
    environment_differences: list[str]
    steps_replayed: int
    steps: list[StepSummary]
    divergences: list[Divergence]
    num_divergences: int
    run_to_run: str | None  # with --repeat: "deterministic" or where the repeats parted
    replay_s: float
    record_execute_s: float  # the recording's own runner time for the same steps (from its timings)
    plant: Plant | None = None
    first_token_flip: Divergence | None = None  # the first divergence that changed a token, if any
    # sampled tokens of random-sampling requests that differ but cannot be compared: vLLM drew them with its own
    # sampler kernels and random streams, which only vLLM's runner repeats (not counted in num_divergences)
    foreign_draws_differ: int = 0


def _random(sp) -> bool:
    """A random-sampling (temperature > 0) request."""
    return sp is not None and sp.temperature >= SAMPLING_EPS


def _digest(mro) -> bytes:
    return hashlib.sha256(fmt.WIRE_ENCODER.encode(mro)).digest() if mro is not None else b""


def _repro(path: str, step: int, opts: ReplayOptions) -> str:
    args = ["replay", "run", path, "--diff", "--steps", f"{step}-{step}", "--mode", opts.mode]
    for k, v in opts.overrides.items():
        args += ["--set", f"{k}={v}"]
    if opts.plant is not None:
        p = opts.plant
        args += ["--plant", f"{p.step}:{p.request}:{p.module}:{p.size}"]
    return " ".join(shlex.quote(a) for a in args)


def _one_pass(path, opts: ReplayOptions, rng: StepRange | None, digests: list[bytes] | None):
    """Replay once. Returns (summaries, divergences, count, first batch, env diffs, steps, seconds, record s)."""
    with CaptureReader(path) as r:
        built = build_runner(r.header, opts.overrides, force=opts.force)
        runner = built.runner
        ext: dict[str, str] = {}
        internal_of: dict[str, str] = {}
        positions: dict[str, int] = {}
        prev_sampled: dict[str, list[int]] = {}
        summaries: list[StepSummary] = []
        divergences: list[Divergence] = []
        count = 0
        first_batch = None
        steps = 0
        replay_s = record_s = 0.0
        expected_index = None
        # vLLM draws random samples with its own kernels and streams (unseeded requests: the global generator;
        # on CPU even seeded ones: a fused SplitMix64 Gumbel kernel). Only vLLM's own runner repeats those draws;
        # elsewhere the tokens of random-sampling requests are not compared (their logprobs still are).
        foreign_draws = r.header.engine == "vllm" and not getattr(runner, "repeats_vllm_draws", False)
        foreign_random: set[str] = set()
        for rec in r.records():
            if isinstance(rec, RequestAdded):
                rid = rec.request.request_id
                ext[rid] = rec.request.external_req_id or rid
                internal_of[ext[rid]] = rid
                continue
            if not isinstance(rec, Step):
                continue
            if expected_index is None and rec.index != 0:
                raise UsageError(f"{path}: capture starts at step {rec.index}, not at a clean boundary (step 0): "
                                 "a SchedulerOutput is a diff against state the runner never saw")
            if expected_index is not None and rec.index != expected_index:
                raise UsageError(f"{path}: steps {expected_index}-{rec.index - 1} are missing (damaged capture?): "
                                 "replay cannot skip steps")
            expected_index = rec.index + 1
            if rng is not None and rng.last is not None and rec.index > rng.last:
                break
            so, expected = rec.scheduler_output, rec.model_runner_output
            if foreign_draws:
                foreign_random.update(n.req_id for n in so.scheduled_new_reqs if _random(n.sampling_params))
            t = time.perf_counter()
            runner.update_states(so, rec.drawn_seeds, prev_sampled if opts.mode == "forced" else None)
            actual = _run(runner, so, rec.grammar_output, rec.index, opts, internal_of)
            replay_s += time.perf_counter() - t
            if rec.timing is not None:
                record_s += rec.timing.execute_ns / 1e9
            steps += 1
            if digests is not None:
                digests.append(_digest(actual))
            if opts.diff and (rng is None or rec.index >= rng.first):
                summary, divs = compare_step(rec.index, expected, actual, ext, positions, opts.tolerance,
                                             runner.last_margins, so.total_num_scheduled_tokens, foreign_random)
                summaries.append(summary)
                if divs and first_batch is None:
                    first_batch = batch_composition(rec.index, so, ext)
                count += len(divs)
                divergences.extend(divs[: max(0, opts.max_divergences - len(divergences))])
            if expected is not None:
                prev_sampled = {rid: toks for rid, toks in zip(expected.req_ids, expected.sampled_token_ids) if toks}
                for rid, toks in prev_sampled.items():
                    positions[rid] = positions.get(rid, 0) + len(toks)
            if opts.progress:
                print(f"\rreplayed step {rec.index}", end="", file=sys.stderr, flush=True)
        if opts.progress:
            print(file=sys.stderr)
        if r.damage:
            from replay.errors import CaptureDamagedError

            raise CaptureDamagedError(path, f"capture is damaged ({r.damage[0].describe()}); replay needs every step "
                                      "(try `replay recover` and replay a prefix with --steps)")
        return summaries, divergences, count, first_batch, built.environment.differences, steps, replay_s, record_s


def _run(runner, so, grammar, index: int, opts: ReplayOptions, internal_of: dict[str, str]):
    """Run one step (with its recorded grammar bitmask), with the planted perturbation when this is its step."""
    p = opts.plant
    if p is None or p.step != index:
        return runner.run_step(so, grammar)
    rid = internal_of.get(p.request, p.request)
    if rid not in so.num_scheduled_tokens:
        raise UsageError(f"--plant: request {p.request!r} is not scheduled in step {index}")
    snap = runner.snapshot_step(so)
    handle = install(p, runner, rid)
    try:
        planted = runner.run_step(so, grammar)
    finally:
        handle.remove()
    runner.restore_step(snap)
    runner.run_step(so, grammar)  # the clean run leaves the state (KV, generators) as if nothing was planted
    if opts.mode == "free":  # ...but in free mode the planted tokens go on, as a real fault's would
        for rid_, toks in zip(planted.req_ids, planted.sampled_token_ids):
            st = runner.requests.get(rid_)
            if toks and st is not None:
                st.output_token_ids[-len(toks):] = toks
    return planted


def replay_capture(path: str | os.PathLike, opts: ReplayOptions | None = None) -> ReplayReport:
    """Replay `path` (`opts.repeat` times) and diff it against the recording."""
    opts = opts or ReplayOptions()
    if opts.mode not in MODES:
        raise UsageError(f"--mode {opts.mode!r}: expected forced or free")
    if opts.repeat < 1:
        raise UsageError("--repeat must be at least 1")
    rng = StepRange.parse(opts.steps) if opts.steps else None
    runs = []
    for i in range(opts.repeat):
        digests: list[bytes] = []
        runs.append((_one_pass(path, opts, rng, digests), digests))
    (summaries, divs, count, batch, env, steps, replay_s, record_s), first_digests = runs[0]
    run_to_run = None
    if opts.repeat > 1:
        run_to_run = f"deterministic: {opts.repeat} replays bitwise identical"
        for k, (_, digests) in enumerate(runs[1:], 2):
            for s, (a, b) in enumerate(zip(first_digests, digests)):
                if a != b:
                    run_to_run = f"NOT deterministic: replay {k} differs from replay 1 at step {s}"
                    break
            if run_to_run.startswith("NOT"):
                break
    divs.sort(key=lambda d: (d.step, d.kind != "token"))
    first = divs[0] if divs else None
    return ReplayReport(str(path), opts.mode, bool(count), first, batch if first else None,
                        _repro(str(path), first.step, opts) if first else None, opts.tolerance, env, steps,
                        summaries, divs, count, run_to_run, round(replay_s, 4), round(record_s, 4), opts.plant,
                        next((d for d in divs if d.kind == "token"), None),
                        sum(s.foreign_draws_differ for s in summaries))


def check_capture(path: str | os.PathLike, opts: ReplayOptions | None = None) -> int:
    """`git bisect run` predicate: 0 replays within tolerance, 1 diverges, 125 cannot test."""
    from replay.errors import EXIT_CANNOT_TEST, EXIT_OK

    try:
        report = replay_capture(path, opts)
    except ReplayError:
        return EXIT_CANNOT_TEST
    except Exception:  # noqa: BLE001 - an engine that fails to start cannot be tested, whatever the reason
        return EXIT_CANNOT_TEST
    return EXIT_DIVERGED if report.diverged else EXIT_OK
