"""Builds the runner a capture is replayed on, from its header plus `--set KNOB=VALUE` overrides, and names every
difference between the recording and the replay environment that can change numerics (DESIGN §2.5)."""

from __future__ import annotations

import msgspec

from replay.capture import Header
from replay.errors import UsageError

KNOBS = ("dtype", "attention", "threads", "device", "model", "seed", "batch_invariant", "runner")


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
        out[key] = value.strip()
    return out


class ReplayEnvironment(msgspec.Struct):
    """What the replay runs with, next to what the capture was recorded with."""

    differences: list[str]  # human lines, one per difference that can change numerics
    model_mismatch: str | None  # set when the model itself differs (refused without --force)


class BuiltRunner(msgspec.Struct):
    """A runner ready for step 0, and how its environment differs from the recording."""

    runner: object
    environment: ReplayEnvironment
    engine: str


def build_runner(header: Header, overrides: dict[str, str], *, force: bool = False, extra_blocks: int = 0) -> BuiltRunner:
    """A fresh runner for `header`'s engine. Raises UsageError (exit 2) for a capture no runner can replay and
    for a different model without `force`."""
    runner = overrides.get("runner", "builtin")
    if runner == "vllm":
        from replay.integrations.vllm.runner import VllmRunner

        diffs = [] if header.engine == "vllm" else [f"runner: recorded on {header.engine}, replay on vllm"]
        return BuiltRunner(VllmRunner(header, overrides), ReplayEnvironment(diffs, None), "vllm")
    if runner != "builtin":
        raise UsageError(f"--set runner={runner!r}: expected builtin or vllm")
    if header.engine == "builtin" or (header.model is not None and header.engine not in ("synthetic",)):
        return _build_builtin(header, overrides, force, extra_blocks)
    raise UsageError(f"capture recorded by engine {header.engine!r} has no model to replay it on "
                     "(record one with `replay record`)")


def _build_builtin(header: Header, overrides: dict[str, str], force: bool, extra_blocks: int = 0) -> BuiltRunner:
    import torch

    from replay.engine.runner import ModelRunner
    from replay.engine.weights import load_model
    from replay.environment import current_environment

    m, ec, env = header.model, header.engine_config, header.environment
    if m is None:
        raise UsageError("capture header names no model; cannot replay it")
    model_ref = overrides.get("model") or m.path or m.name
    dtype = overrides.get("dtype", m.dtype or "float32")
    device = overrides.get("device", ec.extra.get("device", "cpu"))
    # another engine's attention backend is not one of ours: cross-implementation replays use our default
    own = ec.attention_impl if header.engine == "builtin" else ""
    attention = overrides.get("attention", own or "sdpa")
    seed = int(overrides.get("seed", ec.seed or 0))
    invariant = str(overrides.get("batch_invariant", ec.batch_invariant)).lower() in ("1", "true", "yes", "on")
    if "threads" in overrides:
        try:
            torch.set_num_threads(int(overrides["threads"]))
        except ValueError:
            raise UsageError(f"--set threads={overrides['threads']!r}: expected an integer") from None
    elif env.num_threads:
        torch.set_num_threads(env.num_threads)  # the recorded thread count, unless told otherwise
    model, model_cfg, fingerprint = load_model(model_ref, dtype, device)
    eos = model_cfg.eos_token_id
    eos = eos[0] if isinstance(eos, list) and eos else (eos if isinstance(eos, int) else None)
    runner = ModelRunner(model, max(ec.num_gpu_blocks, 1) + extra_blocks, ec.block_size, attention_impl=attention, seed=seed,
                         eos_token_id=eos, batch_invariant=invariant)
    now = current_environment(device=device)
    diffs = []

    def note(what, recorded, replay):
        if str(recorded) != str(replay):
            diffs.append(f"{what}: recorded {recorded}, replay {replay}")

    note("dtype", m.dtype, dtype)
    note("attention", ec.attention_impl if header.engine == "builtin"
         else f"{header.engine} {ec.attention_impl or 'default backend'}", attention)
    note("batch-invariant mode", ec.batch_invariant, invariant)
    note("device", env.device, now.device)
    note("torch", env.torch_version, now.torch_version)
    note("threads", env.num_threads, now.num_threads)
    note("deterministic algorithms", env.deterministic_algorithms, now.deterministic_algorithms)
    note("float32 matmul precision", env.matmul_precision, now.matmul_precision)
    note("cuda", env.cuda_version or "-", now.cuda_version or "-")
    mismatch = None
    if m.fingerprint and fingerprint != m.fingerprint:
        mismatch = (f"model weights differ from the recording's (fingerprint {m.fingerprint[:12]} recorded, "
                    f"{fingerprint[:12]} loaded from {model_ref})")
        if not force:
            raise UsageError(f"{mismatch}; pass --force to replay on this model anyway")
        diffs.insert(0, mismatch)
    return BuiltRunner(runner, ReplayEnvironment(diffs, mismatch), "builtin")
