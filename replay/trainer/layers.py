"""`replay trainer --bisect`: one token's forward on both sides, module by module. The replay side is the recorded
step on the capture's runner (vLLM's own model and kernels in every worker, or the builtin runner), hooked as `bisect
layers` hooks it; the trainer side is one teacher-forced `transformers` forward of the sequence up to the token,
hooked on every module; or, `against="builtin"`, the builtin runner's replay of the same step (our reference modules
standing where the trainer stands, beside vLLM's runner). vLLM's fused modules are compared with the trainer's put
together: `qkv_proj` against `q_proj`, `k_proj`, `v_proj` side by side, `gate_up_proj` against `gate_proj` and
`up_proj`, `attn` and `act_fn` against what `o_proj` and `down_proj` take in, `logits_processor` against `lm_head`.
The first module whose output moves beyond the dtype's tolerance (relative to the module's largest output) is named,
with |Δ| and ULPs."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import torch.nn.functional as F

from replay.bisect.dump import write_dump
from replay.bisect.layers import side_runs
from replay.bisect.module_compare import LayersBisect, ModuleDiff, compare_modules
from replay.bisect.session import Run
from replay.errors import UsageError
from replay.integrations.vllm.engines import Engines
from replay.replayer import Plant
from replay.trainer.forward import load_model, model_device
from replay.trainer.rollouts import read_rollouts

# |Δ| / the module's largest |output| beyond which a module has moved: ~100 float32 ULPs; a few bfloat16 ones
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2e-2}
AGAINST = ("transformers", "builtin")  # what stands on the trainer's side


class ModuleGap(msgspec.Struct):
    """One module: the replay side against the trainer's."""

    module: str
    trainer: str  # the trainer side's module(s) it is compared with
    max_abs: float
    relative: float  # max |Δ| / the replay side's largest |output|
    max_ulps: float
    beyond: bool  # beyond the dtype's tolerance


class TrainerLayers(msgspec.Struct):
    """The answer of `replay trainer --bisect`."""

    capture: str
    request: str
    position: int  # output position of the token
    step: int
    runner: str  # the replay side: "vllm" or "builtin"
    dtype: str
    tolerance: float
    verdict: str
    first_module: str | None  # the first beyond the tolerance
    first_differs: str | None  # the first whose output is not bitwise the trainer's (within tolerance or not)
    modules: list[ModuleGap]  # in the replay side's execution order
    unmatched: int = 0  # replay-side modules with no counterpart on the trainer's side
    notes: list[str] = []
    dump: str | None = None
    against: str = "transformers"  # the trainer's side: its transformers forward, or the builtin runner

    @property
    def other(self) -> str:
        """What stands on the trainer's side, as a verdict names it."""
        return side_name(self.against)


def check_against(against: str) -> None:
    """Refuse, in one line, a trainer's side that is neither of `AGAINST`."""
    if against not in AGAINST:
        raise UsageError(f"--against {against}: expected one of {', '.join(AGAINST)}")


def side_name(against: str) -> str:
    """"the trainer" (transformers) or "the builtin runner": what stands on the trainer's side."""
    return "the trainer" if against == "transformers" else "the builtin runner"


def trainer_layers(path: str | os.PathLike, request: str, position: int, *, model_path: str, dtype: str,
                   attention: str = "sdpa", runner: str | None = None, plant: Plant | None = None,
                   engines: Engines | None = None, hook: Callable[[Any], None] | None = None,
                   dump: str | os.PathLike | None = None, model: Any | None = None,
                   against: str = "transformers", device: str = "cpu") -> TrainerLayers:
    """The first module whose output for one token moves beyond the dtype's tolerance between the replay's step and
    the trainer's forward (the module docstring says how modules are paired). `plant`: a fault on the replay side
    (`--plant`); `hook(model)`: called on the trainer's transformers model once loaded (a test plants the trainer
    side's fault with it); `dump`: a directory for both sides' outputs of the modules around the first one beyond the
    tolerance; `model`: the trainer's model, already loaded from `model_path` in `dtype` (else it is loaded here);
    `against`: "transformers" (the trainer's forward) or "builtin" (the builtin runner's replay of the step, in
    `dtype`, on the trainer's side); `device`: where the trainer's forward runs (the builtin runner's replay stays on
    the CPU)."""
    path = str(path)
    check_against(against)
    data = read_rollouts(path, [request])
    if not data.rollouts:
        raise UsageError(data.none_generated(path, [request]))
    r = data.rollouts[0]
    if not r.prompt:
        raise UsageError(f"--token {request}:{position}: its prompt has no token ids (prompt embeddings)")
    if not 0 <= position < len(r.tokens):
        raise UsageError(f"--token {request}:{position}: it generated {len(r.tokens)} tokens (positions 0-"
                         f"{len(r.tokens) - 1})")
    step = r.steps[position]
    if r.steps.count(step) > 1:
        raise UsageError(f"--token {request}:{position}: step {step} sampled {r.steps.count(step)} of its tokens "
                         "(speculative decoding): pick a token of a step that sampled one")
    runner = runner or ("vllm" if data.header.engine == "vllm" else "builtin")
    if against == "builtin" and runner == "builtin":
        raise UsageError("--against builtin: the replay side is the builtin runner already (--runner vllm for a "
                         "vLLM capture)")
    _, notes, (run,) = side_runs(path, step, r.name, {"runner": runner} if runner == "vllm" else {},
                                 [(False, plant)], engines=engines)
    replay_side = [(n, t) for n, t in run.modules if not _skipped(n, runner)]
    if not replay_side:
        raise UsageError(f"{path}: the replay of step {step} hooked no module of request {r.name}")
    rows = replay_side[0][1].shape[0]  # R's rows at the step: the embedding's
    if against == "builtin":
        trainer_side, sources = _builtin_modules(path, step, r.name, dtype)
    else:
        model = model if model is not None else load_model(model_path, dtype, attention, device)
        if hook is not None:
            hook(model)
        seq = r.prompt + r.tokens[:position]
        trainer_side, sources = _trainer_modules(model, seq, range(len(seq) - rows, len(seq)))
    prefix = "model." if replay_side[0][0].startswith("model.") else ""
    mine = [(n, _sampled_rows(n, trainer_side[n.removeprefix(prefix)], t)) for n, t in replay_side
            if n.removeprefix(prefix) in trainer_side]
    diffs = compare_modules(replay_side, [(n, t.to(dict(replay_side)[n].dtype)) for n, t in mine], run.gathered)
    scale = {n: float(t.double().abs().max()) for n, t in replay_side}
    tol = TOLERANCE.get(dtype, TOLERANCE["float32"])
    gaps = [ModuleGap(d.module, sources.get(d.module.removeprefix(prefix), d.module.removeprefix(prefix)), d.max_abs,
                      d.max_abs / max(scale[d.module], 1e-30), d.max_ulps, d.max_abs > tol * scale[d.module])
            for d in diffs]
    first = next((g for g in gaps if g.beyond), None)
    differs = next((g for g in gaps if g.max_abs > 0), None)
    on = ", on vLLM's runner" if runner == "vllm" else ""
    where = f"request {r.name}, output position {position} (step {step}{on})"
    other = side_name(against)
    if differs is None:
        verdict = f"{where}: every module's output ({len(gaps)} compared) is bitwise {other}'s"
    elif first is None:
        worst = max(gaps, key=lambda g: g.relative)
        verdict = (f"{where}: the first module that differs from {other} is {differs.module} (max |Δ| "
                   f"{differs.max_abs:.3g}, {differs.max_ulps:.3g} ULPs); none moves beyond {dtype}'s tolerance "
                   f"(relative {tol:g}; the largest: {worst.module}, relative {worst.relative:.3g})")
    else:
        verdict = (f"{where}: the first module beyond {dtype}'s tolerance (relative {tol:g}) against {other} is "
                   f"{first.module} ({other}'s {first.trainer}; max |Δ| {first.max_abs:.3g}, relative "
                   f"{first.relative:.3g}, {first.max_ulps:.3g} ULPs)")
    compared = {d.module for d in diffs}
    shaped = [n for n, _ in mine if n not in compared]  # a counterpart, but not of the same shape: said by name
    if shaped:
        notes = [*notes, f"not compared, their shape differs from {other}'s: {', '.join(shaped[:6])}"
                 + (f" and {len(shaped) - 6} more" if len(shaped) > 6 else "")]
    res = TrainerLayers(path, r.name, position, step, runner, dtype, tol, verdict, first.module if first else None,
                        differs.module if differs else None, gaps, len(replay_side) - len(diffs), list(notes),
                        against=against)
    if dump is not None:
        lb = LayersBisect(path, step, r.name, "trainer", verdict, res.first_module,
                          [ModuleDiff(d.module, not g.beyond and d.equal, d.max_abs, d.max_ulps, d.gathered)
                           for d, g in zip(diffs, gaps)], runner)
        res.dump = write_dump(dump, lb, Run(None, [], replay_side, run.gathered), Run(None, [], mine))
    return res


def _skipped(name: str, runner: str) -> bool:
    """Replay-side outputs with no trainer counterpart by construction: a tuple's later parts (vLLM's residual), a
    shared module's later calls, and on vLLM a decoder layer's output (its residual is not added yet)."""
    return "[" in name or "#" in name or (runner == "vllm" and re.search(r"layers\.\d+$", name) is not None)


def _sampled_rows(name: str, trainer: torch.Tensor, replay: torch.Tensor) -> torch.Tensor:
    """The trainer's output of module `name` on the replay's rows: an engine computes logits (`lm_head`) only for the
    rows that sample, the last of a prefill's, where the trainer's forward computes them for every row."""
    if name.endswith("lm_head") and trainer.shape[1:] == replay.shape[1:] and 0 < len(replay) < len(trainer):
        return trainer[-len(replay):]
    return trainer


def _trainer_modules(model: Any, seq: list[int], rows: range) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every module's output rows at `rows` for one teacher-forced forward of `seq`, by name (without a leading
    "model."), with vLLM's fused modules put together from the trainer's (see the module docstring); and for those,
    which of the trainer's modules each is made of."""
    out: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    device = model_device(model)
    sel = torch.tensor(list(rows), device=device)

    def keep(name: str, into: dict, value: Any) -> None:
        t = value[0] if isinstance(value, tuple) else value
        if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[1] == len(seq):  # (compared on the CPU)
            into[name.removeprefix("model.")] = t[0, sel].detach().to("cpu", copy=True)

    handles = []
    for name, m in model.named_modules():
        if name:
            handles.append(m.register_forward_hook(lambda mod, a, o, n=name: keep(n, out, o)))
        if name.endswith(("self_attn.o_proj", "mlp.down_proj")):
            handles.append(m.register_forward_pre_hook(lambda mod, a, n=name: keep(n, inputs, a)))
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([seq], device=device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return out, _put_together(out, inputs)


def _builtin_modules(path: str, step: int, request: str, dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The builtin runner's module outputs for `request`'s rows at `step` (replayed in `dtype`), by name, with vLLM's
    fused modules put together as from the trainer's. Its attention's output is `o_proj`'s input, and its MLP computes
    `down_proj(silu(gate) * up)`: the product, computed here the same way, is `down_proj`'s input."""
    _, _, (run,) = side_runs(path, step, request, {"dtype": dtype}, [(False, None)])
    out = {n.removeprefix("model."): t for n, t in run.modules}
    inputs = {}
    for name in out:
        if name.endswith("self_attn.attn"):
            inputs[name.removesuffix("attn") + "o_proj"] = out[name]
        if name.endswith("mlp.gate_proj"):
            base = name.removesuffix("gate_proj")
            inputs[base + "down_proj"] = F.silu(out[name]) * out[base + "up_proj"]
    return out, _put_together(out, inputs)


def _put_together(out: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> dict[str, str]:
    """vLLM's fused modules from the separate ones in `out` (added to it), `o_proj`'s and `down_proj`'s inputs from
    `inputs`; returns which of the separate modules each is made of."""
    sources: dict[str, str] = {}
    for name in list(out):
        if name.endswith("self_attn.q_proj"):
            base = name.removesuffix("q_proj")
            out[base + "qkv_proj"] = torch.cat([out[base + p] for p in ("q_proj", "k_proj", "v_proj")], dim=-1)
            out[base + "attn"] = inputs[base + "o_proj"]
            sources[base + "qkv_proj"] = base + "q_proj|k_proj|v_proj"
            sources[base + "attn"] = f"{base}o_proj's input"
        if name.endswith("mlp.gate_proj"):
            base = name.removesuffix("gate_proj")
            out[base + "gate_up_proj"] = torch.cat([out[base + "gate_proj"], out[base + "up_proj"]], dim=-1)
            out[base + "act_fn"] = inputs[base + "down_proj"]  # vLLM's act_fn is SiluAndMul: silu(gate) * up
            sources[base + "gate_up_proj"] = base + "gate_proj|up_proj"
            sources[base + "act_fn"] = f"{base}down_proj's input"
    if "lm_head" in out:
        out["logits_processor"] = out["lm_head"][-1:]  # vLLM scores the sampling row only
        sources["logits_processor"] = "lm_head"
    return sources
