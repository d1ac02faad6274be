"""`StepLoop`: the one replay loop. It walks a capture's steps in order on a runner, applying each recorded
`SchedulerOutput` (a diff against the runner's state, so replay starts from an empty runner at step 0 and
skips nothing) and running the step.

Modes, named as vLLM names them:
- `forced` (default; vLLM's "trace replay"): before each step the runner's cached sampled tokens are overwritten
  with the recorded ones, so every step runs on the recorded trajectory and each step's diff is local;
- `free`: the runner keeps its own samples, which shows how far a divergence propagates.

`replay_capture` diffs every step it yields; `StepSession` (bisect) replays up to a step and stops before it. A
step the recording crashed on (a `Crash` record precedes it) is re-executed last and not yielded: what it raises,
or that it raises nothing, is kept in `crash` for the report.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Iterator

import msgspec

from replay.capture import Crash, Keyframe, Record, RequestAdded, Step
from replay.contracts import ModelRunnerOutput
from replay.errors import CannotTestError, ReplayError, UsageError
from replay.replayer.build import Runner
from replay.replayer.prime import Priming, prime
from replay.replayer.swap import Swap

MODES = ("forced", "free")
# vLLM's multiprocess executor re-raises a worker's exception as its own RuntimeError around the worker's message:
# the same failure as the one-process executor raises bare (a server's crash replayed in this process)
_WORKER_FAILED = re.compile(r"^RuntimeError: Worker failed with error '(.*)', please check the stack trace above "
                            r"for the root cause$", re.S)


def _root(described: str) -> str:
    """An exception as `Crash.describe` puts it, out of vLLM's multiprocess wrapper: 'RuntimeError: <message>'."""
    m = _WORKER_FAILED.match(described)
    return f"RuntimeError: {m.group(1)}" if m else described


class CrashOutcome(msgspec.Struct):
    """The recording's crash at `step`, re-executed: what it raised then and what it raises now."""

    step: int
    recorded: str  # "RuntimeError: CPU Generator does not use offset"
    replayed: str | None  # the same form, or None when the step ran through
    reproduced: bool  # same exception type and message


def check_mode(mode: str) -> None:
    """Refuse a mode that is neither forced nor free."""
    if mode not in MODES:
        raise UsageError(f"--mode {mode!r}: expected forced or free")


class StepLoop:
    """Replays steps on `runner` and keeps what every consumer of a replay needs to know along the way."""

    def __init__(self, path: str | os.PathLike, runner: Runner, mode: str = "forced", *,
                 keyframe: int | None = None, prime_budget: int = 2048) -> None:
        check_mode(mode)
        self.path = str(path)
        self.runner = runner
        self.forced = mode == "forced"
        self.external: dict[str, str] = {}  # internal request id -> the user's id (or the internal one)
        self.internal: dict[str, str] = {}  # the user's id -> internal id
        self.positions: dict[str, int] = {}  # output tokens each request had before the step being run
        self.sampled: dict[str, list[int]] = {}  # the recorded tokens of the last step run (forced mode feeds them)
        self.steps_run = 0
        self.execute_s = 0.0  # wall time spent in the runner
        self.next_step: Step | None = None  # with `until`: the step the loop stopped before
        self.stopped: str | None = None  # why the loop ended before the capture did (steps missing after a gap)
        self.crash: CrashOutcome | None = None  # the recorded crash, re-executed (when the capture has one)
        self.skip: set[str] = set()  # requests left out of every step (a --force replay of what cannot run)
        self.swap: Swap | None = None  # requests whose tokens are rewritten in every step, shapes kept (`swap`)
        # replay from the keyframe of this step (None: from step 0): records before it are skipped, the runner is
        # primed from it (`prime`), `prime_budget` tokens a priming step
        self.keyframe = keyframe
        self.prime_budget = prime_budget
        self.priming: Priming | None = None
        self._crash: Crash | None = None

    def steps(self, records: Iterable[Record]) -> Iterator[Step]:
        """The steps among `records`, checked to start at step 0; a gap (steps lost with a damaged chunk) ends them
        there, with the reason in `stopped`: a step after it is a diff against state the runner never saw.
        Request arrivals are noted on the way."""
        expected = None
        for rec in records:
            if self.keyframe is not None and self.priming is None:
                if isinstance(rec, Keyframe) and rec.step == self.keyframe:
                    self._prime(rec)
                    expected = rec.step
                continue  # what came before the keyframe is in it
            if isinstance(rec, RequestAdded):
                rid = rec.request.request_id
                self.external[rid] = rec.request.name
                self.internal[self.external[rid]] = rid
                continue
            if isinstance(rec, Crash):
                self._crash = rec
                continue
            if not isinstance(rec, Step):
                continue
            if expected is None and rec.index != 0:
                raise UsageError(f"{self.path}: capture starts at step {rec.index}, not at a clean boundary (step 0): "
                                 "a SchedulerOutput is a diff against state the runner never saw")
            if expected is not None and rec.index != expected:
                self.stopped = (f"steps {expected}-{rec.index - 1} are missing: the replay stops after step "
                                f"{expected - 1}")
                return
            expected = rec.index + 1
            if self.priming is not None:
                self.priming.note_step(rec.scheduler_output)
            yield self._transformed(rec)
        if self.keyframe is not None and self.priming is None:
            raise UsageError(f"{self.path}: no keyframe at step {self.keyframe}")

    def _prime(self, kf: Keyframe) -> None:
        """Start from a keyframe: the runner rebuilt (`prime`), its live requests named and positioned."""
        for r in kf.requests:
            rid = r.request.request_id
            self.external[rid] = r.request.name
            self.internal[r.request.name] = rid
            self.positions[rid] = len(r.output_token_ids)
        changed = self.skip | set(self.swap.kinds if self.swap else ())
        live = [r.request.request_id for r in kf.requests if r.scheduled and r.request.request_id in changed]
        if live:
            raise UsageError(f"{self.path}: request {live[0]!r} is live at the keyframe of step {kf.step}: a replay "
                             "from it can neither leave it out nor swap its content")
        self.priming = prime(self.runner, kf, self.prime_budget)

    def _transformed(self, step: Step) -> Step:
        """`step` as the runner gets it: the requests in `skip` left out (their outputs are not compared), those in
        `swap` with their tokens rewritten."""
        if not self.skip and not self.swap:
            return step
        so, go = step.scheduler_output, step.grammar_output
        if self.skip:
            if go is not None:
                go = go.without(self.skip, so.scheduled_spec_decode_tokens)
            so = so.without(self.skip)
        if self.swap:
            so = self.swap.step(so)
        return msgspec.structs.replace(step, scheduler_output=so, grammar_output=go)

    def execute(self, step: Step, run: Callable[[Step], ModelRunnerOutput] | None = None) -> ModelRunnerOutput:
        """Apply the step's diff (in forced mode with the last step's recorded tokens) and run it: with
        `runner.run_step`, or with `run` (the replayer's planted re-execution)."""
        t = time.perf_counter()
        self.runner.update_states(step.scheduler_output, step.drawn_seeds, self.sampled if self.forced else None)
        actual = run(step) if run is not None else self.runner.run_step(step.scheduler_output, step.grammar_output)
        self.execute_s += time.perf_counter() - t
        self.steps_run += 1
        return actual

    def _reexecute_crash(self, step: Step, crash: Crash,
                         run: Callable[[Step], ModelRunnerOutput] | None) -> CrashOutcome:
        """Run the step the recording crashed on; an exception is the outcome, not an error of the replay."""
        try:
            self.execute(step, run)
            replayed = None
        except Exception as e:  # noqa: BLE001 - whatever the engine raises is what is compared
            replayed = Crash(step.index, type(e).__name__, str(e)).describe()
        recorded = crash.describe()
        return CrashOutcome(step.index, recorded, replayed, replayed is not None and _root(replayed) == _root(recorded))

    def advance(self, step: Step) -> None:
        """Move past `step`: its recorded tokens become the cached ones and count towards output positions."""
        out = step.model_runner_output
        if out is None:
            return
        self.sampled = {rid: toks for rid, toks in zip(out.req_ids, out.sampled_token_ids) if toks}
        for rid, toks in self.sampled.items():
            self.positions[rid] = self.positions.get(rid, 0) + len(toks)
        if self.swap:
            self.sampled = self.swap.sampled(self.sampled)

    def replay(self, records: Iterable[Record], *, last: int | None = None, until: int | None = None,
               run: Callable[[Step], ModelRunnerOutput] | None = None) -> Iterator[tuple[Step, ModelRunnerOutput]]:
        """Run every step up to `last` (inclusive) or up to `until` (exclusive: that step is kept in `next_step`),
        yielding each with the runner's output before moving past it."""
        for step in self.steps(records):
            if last is not None and step.index > last:
                return
            if until is not None and step.index == until:
                self.next_step = step
                return
            if self._crash is not None and self._crash.step == step.index:
                self.crash = self._reexecute_crash(step, self._crash, run)
                return
            try:
                actual = self.execute(step, run)
            except ReplayError:
                raise
            except Exception as e:
                if getattr(self.runner, "kind", "") != "vllm":
                    raise  # (a failure of our own runner is ours to report)
                # vLLM's kernels failed on a step the recording ran: a replay this install cannot run, not a bug of ours
                raise CannotTestError(f"{self.path}: vLLM's runner raised at step {step.index}, where the recording "
                                      f"did not: {' '.join(f'{type(e).__name__}: {e}'.split())[:300]}") from e
            yield step, actual
            self.advance(step)
