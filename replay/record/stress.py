"""`stress`: the Thinking Machines experiment as one command. The same prompt(s), greedy, N times under varied
co-batching (random neighbour requests, sizes and arrival times); count the unique completions and the unique
logprob sequences, and show where they first fork and what the batches looked like there."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from replay.contracts import EngineCoreRequest, ModelRunnerOutput, SamplingParams, SchedulerOutput
from replay.engine.config import EngineConfig
from replay.errors import UsageError
from replay.processes.fanout import FanOut, fan_out
from replay.processes.in_environment import applied, in_environment


class Fork(msgspec.Struct):
    """Where two groups of trials first part, and the batch sizes the target ran in at that position."""

    position: int  # output position of the first difference (tokens or logprobs)
    kind: str  # "token" | "logprob"
    trials: list[int]  # one trial of each side
    batch_sizes: list[int]  # requests in the step that produced that position, per trial
    batch_tokens: list[int]  # tokens in that step, per trial


class StressReport(msgspec.Struct):
    """The answer of `replay stress`."""

    trials: int
    unique_completions: int
    unique_logprob_sequences: int
    first_fork: Fork | None
    batch_invariant: bool  # something promised bitwise repeats (the batch-invariant mode)
    verdict: str
    request: str = ""  # on a capture: the request replayed
    notes: list[str] = []
    left_out: list[int] = []  # on a capture: the neighbours each trial left out
    engine_starts: int = 0  # on a capture: vLLM engines started
    data_lost: list[str] = []  # on a capture: what it lost (the request's steps end where its readable prefix does)


@dataclass(slots=True)
class Watch:
    """A StepListener that keeps the target request's tokens, logprobs (b"" where none were computed) and batch shape
    per output position."""

    target: str
    tokens: list
    logprobs: list
    batch: list

    def on_request_added(self, request: EngineCoreRequest, step: int) -> None:
        """(A listener's hook; arrivals do not matter here.)"""

    def on_request_aborted(self, request_id: str, step: int) -> None:
        """(A listener's hook; aborts do not matter here.)"""

    def on_step_failed(self, index: int, so: SchedulerOutput, error: BaseException) -> None:
        """(A listener's hook; a failed step produced nothing to keep.)"""

    def on_step(self, index: int, so: SchedulerOutput, mro: ModelRunnerOutput | None, **kw: object) -> None:
        """Keep the target's tokens, logprobs and batch shape from the step's output, if it sampled there."""
        if mro is None or self.target not in mro.req_id_to_index:
            return
        i = mro.req_id_to_index[self.target]
        lp = mro.logprobs
        first = lp.first_row(i) if lp is not None else 0
        for k, t in enumerate(mro.sampled_token_ids[i]):  # several per step with spec decode
            self.tokens.append(t)
            self.logprobs.append(np.float32(lp.logprobs.to_numpy()[first + k, 0]).tobytes() if lp is not None else b"")
            self.batch.append((len(so.num_scheduled_tokens), so.total_num_scheduled_tokens))


def prompt_ids(model: str, prompt: str | None = None, prompt_token_ids: str | None = None) -> list[int]:
    """The target prompt's token ids: `prompt` through the model's tokenizer, or comma-separated ids."""
    if (prompt is None) == (prompt_token_ids is None):
        raise UsageError("give exactly one of --prompt and --prompt-token-ids")
    if prompt is not None:
        from replay.engine.tokenizer import load_tokenizer

        tok = load_tokenizer(model)
        if tok is None:
            raise UsageError(f"{model}: no tokenizer.json; use --prompt-token-ids")
        return tok.encode(prompt)
    try:
        return [int(x) for x in prompt_token_ids.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--prompt-token-ids {prompt_token_ids!r}: expected comma-separated integers") from None


def stress(prompt: list[int], config: EngineConfig, *, trials: int = 20, max_tokens: int = 24,
           neighbours: tuple[int, int] = (0, 12), seed: int = 0,
           log: Callable[[str], None] | None = None, how: FanOut = FanOut(),
           env: dict[str, str | None] | None = None) -> StressReport:
    """Run the experiment; neighbours are random prompts (length 4-64, 4-32 output tokens) arriving at random steps.
    Every trial's co-batching is drawn here from `seed`, so trials fanned out `how` (`--jobs`, `--ray`) give the
    serial run's answer. `env`: environment variables (None: unset) the engine runs with, in a fresh process."""
    from replay.engine.weights import load_model_config_for

    if trials < 2:
        raise UsageError("--trials must be at least 2")
    if env and how.ray:
        raise UsageError("--set env.NAME with --ray: Ray's workers start with the cluster's environment, not "
                         "this one (run without --ray, or give the cluster the variables)")
    if env and not applied(env):
        return in_environment(env, stress, prompt, config, trials=trials, max_tokens=max_tokens,
                              neighbours=neighbours, seed=seed, how=how, env=env)
    log = log or (lambda msg: None)
    rng = random.Random(seed)
    vocab = load_model_config_for(config.model).vocab_size
    plans = []
    for _ in range(trials):  # the draws in the order the serial loop always made them
        k = rng.randint(*neighbours)
        arrivals = sorted((rng.randint(0, 6), [rng.randrange(3, vocab) for _ in range(rng.randint(4, 64))],
                           rng.randint(4, 32)) for _ in range(k))
        plans.append(_Trial(prompt, config, arrivals, rng.randint(0, 4), max_tokens))
    runs: list[Watch | None] = [None] * trials
    for i, watch in fan_out(run_trial, plans, how):
        runs[i] = watch
        log(f"  trial {i + 1}/{trials}: {len(plans[i].arrivals)} neighbours, "
            f"{len(set(b for b, _ in watch.batch))} batch sizes")
    completions = {tuple(r.tokens) for r in runs}
    sequences = {tuple(r.logprobs) for r in runs}
    fork = first_fork(runs)
    invariant = config.runner.batch_invariant
    mode = "batch-invariant mode" if invariant else "default mode"
    verdict = (f"{trials} trials in {mode}: {len(completions)} unique completion(s), {len(sequences)} unique logprob "
               f"sequence(s)")
    if fork is not None:
        verdict += f"; they first fork at output position {fork.position} ({fork.kind}s differ)"
    return StressReport(trials, len(completions), len(sequences), fork, invariant, verdict)


@dataclass(slots=True)
class _Trial:
    """One trial's plan: the target prompt, and the neighbours arriving at which steps."""

    prompt: list[int]
    config: EngineConfig
    arrivals: list[tuple[int, list[int], int]]  # (arrival step, prompt ids, max tokens), in arrival order
    target_at: int
    max_tokens: int


def run_trial(t: _Trial) -> Watch:
    """Run one trial on a fresh engine (in whichever process or Ray worker runs it): the target's tokens,
    logprobs and batch shapes."""
    from replay.engine.engine import LLMEngine

    engine = LLMEngine(t.config)
    watch = Watch("", [], [], [])
    engine.listeners.append(watch)
    pending = t.arrivals + [(t.target_at, None, t.max_tokens)]
    pending.sort(key=lambda a: a[0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= engine.step_index:
            _, p, n = pending.pop(0)
            if p is None:
                watch.target = engine.add_request(t.prompt, SamplingParams(temperature=0.0, max_tokens=n, logprobs=1,
                                                                           ignore_eos=True), "target")
            else:
                engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        engine.step()
    engine.listeners.remove(watch)
    return watch


def first_fork(runs: list[Watch]) -> Fork | None:
    """Where the trials first part from trial 0: the earliest output position where one differs, and how."""
    best = None
    for i, a in enumerate(runs[1:], 1):
        b = runs[0]
        for pos in range(min(len(a.tokens), len(b.tokens))):
            kind = ("token" if a.tokens[pos] != b.tokens[pos]
                    else "logprob" if a.logprobs[pos] != b.logprobs[pos] else None)
            if kind:
                if best is None or pos < best.position:
                    best = Fork(pos, kind, [0, i], [b.batch[pos][0], a.batch[pos][0]],
                                [b.batch[pos][1], a.batch[pos][1]])
                break
    return best
