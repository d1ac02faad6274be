"""The runner a capture is replayed on: the `Runner` protocol both runners implement, and `build_runner`, which
builds one from the capture's header plus `--set KNOB=VALUE` overrides and names every difference between the
recording and the replay (`replay.provenance.header_differences`; docs/design.md, "Replay")."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from replay.capture import Header, Keyframe
from replay.contracts import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from replay.errors import UsageError
from replay.integrations.vllm.layout import engine_args
from replay.processes.in_environment import applied
from replay.provenance import (
    HeaderDifference,
    header_differences,
    pin_threading,
    set_torch_threads,
    unknown_fields,
)
from replay.replayer.knobs import BOOLEANS, env_knobs

if TYPE_CHECKING:
    from replay.engine.model_runner import ModelRunner
    from replay.integrations.vllm.engines import Engines



class Runner(Protocol):
    """What a replay drives, in vLLM's two phases: the step's diff against the cached state, then the step."""

    ignore_adapters: set[str]  # LoRA adapters (by name) a forced replay runs their requests without

    def repeats(self, recorded: str, seeded: bool) -> bool:
        """Whether a random draw recorded by `recorded`'s sampler ("builtin" | "vllm") comes out the same here."""

    def update_states(self, so: SchedulerOutput, drawn_seeds: dict[str, int] | None = None,
                      sampled_override: dict[str, list[int]] | None = None) -> None:
        """Apply the step's diff; `sampled_override` replaces the tokens cached from the last step (forced mode)."""

    def run_step(self, so: SchedulerOutput, grammar_output: GrammarOutput[str] | None = None) -> ModelRunnerOutput:
        """Forward and sample the scheduled tokens (with the recorded structured-output bitmask)."""

    def margins(self) -> dict[str, float]:
        """top1 - top2 raw logprob per request sampled in the last step, where the runner knows it."""

    def restore_requests(self, keyframe: Keyframe) -> None:
        """Take the keyframe's live requests as it describes them, their K/V already rebuilt, and its persistent batch
        in its order (a replay from a keyframe)."""

    def close(self) -> None:
        """Release what the runner holds (an engine, a redirected terminal); the replay is over."""


@dataclass(slots=True)
class BuiltRunner:
    """A runner ready for step 0, what it replays with, and how that differs from the recording."""

    runner: Runner
    kind: str  # "builtin" | "vllm"
    header: Header  # the replay described as a capture header would describe it
    differences: list[HeaderDifference]  # recorded vs replay, every field that differs (numerics first)
    model_mismatch: str | None = None  # set when the weights differ (refused without --force)
    engine_notes: list[str] = field(default_factory=list)  # what the engine said that changes numerics
    knobs: dict[str, str] = field(default_factory=dict)  # the --set knobs it was built with
    unknown: str = ""  # what the recording's header does not name that the replay's does (`unknown_fields`)

    @property
    def notes(self) -> list[str]:
        """One line per difference that can change numerics, or that a --set knob asked for: 'dtype: recorded
        float32, replay bfloat16'."""
        return [self.model_mismatch] * bool(self.model_mismatch) + [
            d.as_note() for d in self.differences
            if (d.affects in ("hardware", "layout", "numerics", "model") or set_by(d, self.knobs))
            and d.label != "fingerprint"] + [self.unknown] * bool(self.unknown)

    @property
    def host_notes(self) -> list[str]:
        """What differs but cannot change numerics by itself (the platform, Python, the executor that carries the
        calls, a preloaded allocator), and what the engine logged while starting: shown with `-v` and in the
        report's provenance, not on every replay."""
        return [d.as_note() for d in self.differences if d.affects == "host"] + self.engine_notes

    def builtin(self, what: str) -> ModelRunner:
        """The builtin runner, for what needs its internals (snapshots, module hooks); UsageError otherwise."""
        if self.kind != "builtin":
            raise UsageError(f"{what} needs the builtin runner (it re-executes steps with hooks and snapshots); "
                             f"this replay runs on {self.kind}")
        return self.runner  # type: ignore[return-value]


def build_runner(header: Header, overrides: dict[str, str], *, force: bool = False, extra_blocks: int = 0,
                 capture: str | os.PathLike = "replay", engines: Engines | None = None) -> BuiltRunner:
    """A fresh runner for `header`'s capture (`capture`: its path, beside which an engine's own log goes; `engines`:
    started vLLM engines to reuse, see `replay.integrations.vllm.engines`). Raises UsageError (exit 2) for a capture
    no runner can replay and for different weights without `force`."""
    kind = overrides.get("runner", "builtin")
    env = env_knobs(overrides)
    if env and not applied(env):  # too late here: the caller runs this in a process started with them
        raise UsageError(f"--set env.{next(iter(env))}: environment knobs apply to a fresh process; this runner "
                         "would start in one that has torch loaded already (replay.processes.in_environment)")
    if header.model is None or header.engine == "synthetic":
        where = "" if capture == "replay" else f"{capture}: "  # (several captures replay in one command)
        raise UsageError(f"{where}capture recorded by engine {header.engine!r} has no model to replay it on "
                         "(record one with `replay record`)")
    if kind == "vllm":
        from replay.integrations.vllm.vllm_runner import VllmRunner

        runner = VllmRunner(header, overrides, capture, engines)
        replay_header = runner.describe()
        engine_notes = [f"vLLM: {w}" for w in runner.warnings]
    else:
        runner, replay_header = _build_builtin(header, overrides, extra_blocks)
        engine_notes = []
    differences = header_differences(header, replay_header) + knob_differences(header, replay_header, overrides)
    mismatch = None
    if any(d.label == "fingerprint" for d in differences):
        model_ref = replay_header.model.path or replay_header.model.name
        mismatch = (f"model weights differ from the recording's (fingerprint {header.model.fingerprint[:12]} "
                    f"recorded, {replay_header.model.fingerprint[:12]} loaded from {model_ref})")
        if not force:
            runner.close()
            raise UsageError(f"{mismatch}; pass --force to replay on this model anyway")
    return BuiltRunner(runner, kind, replay_header, differences, mismatch, engine_notes, dict(overrides),
                       unknown_fields(header, replay_header))


# header fields (their last name) -> the --set knob that changes them, where the two names differ
_KNOB_OF_FIELD = {"attention_impl": "attention", "num_threads": "threads", "runner_class": "runner", "name": "model",
                  "fingerprint": "model"}


def set_by(d: HeaderDifference, overrides: dict[str, str]) -> bool:
    """Whether a --set knob among `overrides` is what changed this header field (ours, `vllm.ARG` or `env.NAME`)."""
    name = d.field.rsplit(".", 1)[-1]
    knob = _KNOB_OF_FIELD.get(name, name)
    return knob in overrides or f"vllm.{knob}" in overrides or f"env.{knob}" in overrides


def knob_differences(recorded: Header, replay: Header, overrides: dict[str, str]) -> list[HeaderDifference]:
    """What `vllm.ARG` and `env.NAME` knobs set that the headers do not compare (an engine argument no header field
    holds, an environment variable outside the compared ones): one difference each, so that a replay always names
    what it was asked to change."""
    from replay.capture.format.records import EngineConfig
    from replay.provenance.differences import COMPARED_ENV_PREFIXES, UNCOMPARED_ENV

    out = []
    fields = set(EngineConfig.__struct_fields__) | set(recorded.engine_config.layout) | set(replay.engine_config.layout)
    for arg, value in engine_args(overrides).items():
        if arg not in fields:
            out.append(HeaderDifference(f"engine_args.{arg}", f"vllm.{arg}", "not recorded", value, "numerics"))
    for name, value in env_knobs(overrides).items():
        if not name.startswith(COMPARED_ENV_PREFIXES) or name in UNCOMPARED_ENV:
            was = recorded.environment.env.get(name, "unset")
            if was != (value or "unset"):
                out.append(HeaderDifference(f"environment.env.{name}", name, was, value or "unset", "numerics"))
    return out


def _build_builtin(header: Header, overrides: dict[str, str], extra_blocks: int) -> tuple[ModelRunner, Header]:
    """The builtin runner configured as the recording was (unless overridden), and its header."""
    from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
    from replay.engine.engine import builtin_header
    from replay.engine.model_runner import ModelRunner
    from replay.engine.vllm_cpu_draw import fp64_gumbel, seeded_sampler
    from replay.engine.weights import load_model

    m, ec, env = header.model, header.engine_config, header.environment
    model_ref = overrides.get("model") or m.location()
    # A builtin capture replays with the attention it recorded ("sdpa" when it names none: the only one before
    # "batched" became the default); another engine's backend is not one of ours: those replays use our default.
    own = (ec.attention_impl or "sdpa") if header.engine == "builtin" else RunnerConfig().attention_impl
    seed = int(overrides.get("seed", ec.seed or 0))
    threads = int(overrides["threads"]) if "threads" in overrides else env.num_threads or None  # as recorded
    cfg = EngineConfig(
        model=model_ref,
        scheduler=SchedulerConfig(block_size=ec.block_size, num_gpu_blocks=max(ec.num_gpu_blocks, 1) + extra_blocks,
                                  max_num_seqs=ec.max_num_seqs, max_num_batched_tokens=ec.max_num_batched_tokens,
                                  max_model_len=ec.max_model_len, enable_prefix_caching=ec.enable_prefix_caching,
                                  enable_chunked_prefill=ec.enable_chunked_prefill),
        runner=RunnerConfig(dtype=overrides.get("dtype", m.dtype or "float32"),
                            device=overrides.get("device", ec.extra.get("device", "cpu")),
                            attention_impl=overrides.get("attention", own), num_threads=threads,
                            batch_invariant=BOOLEANS[str(overrides.get("batch_invariant", ec.batch_invariant)).lower()],
                            seed=seed, logprobs_mode=ec.logprobs_mode))
    pin_threading()
    if threads:
        got = set_torch_threads(threads)
        if got != threads:  # e.g. OMP_THREAD_LIMIT: the kernels would split their work another way
            raise UsageError(f"threads: the replay needs {threads} but torch here runs {got} (OMP_THREAD_LIMIT?); "
                             "--set threads=N replays with another count, as a difference")
    model, model_cfg, fingerprint = load_model(cfg.model, cfg.runner.dtype, cfg.runner.device)
    eos = model_cfg.eos_token_id
    eos = eos[0] if isinstance(eos, list) and eos else (eos if isinstance(eos, int) else None)
    rc = cfg.runner
    # a vLLM CPU capture's seeded draws are repeatable where its version's sampler is ported: draw them as it did
    vllm_cpu = header.engine == "vllm" and "cpu_model_runner" in ec.runner_class
    runner = ModelRunner(model, cfg.scheduler.num_gpu_blocks, ec.block_size, attention_impl=rc.attention_impl,
                         seed=rc.seed, eos_token_id=eos, batch_invariant=rc.batch_invariant,
                         logprobs_mode=rc.logprobs_mode,
                         vllm_seeded=seeded_sampler(header.engine_version, fp64_gumbel(ec)) if vllm_cpu else "")
    replay_header = builtin_header(cfg, model_cfg, fingerprint)
    replay_header.engine_config.num_gpu_blocks -= extra_blocks  # spare blocks for bisecting are not a difference
    return runner, replay_header
