"""`score_capture`: every rollout of a capture scored by the trainer's forward, against what vLLM returned, like for
like (`semantics.py`), with the figures RL teams log (`figures.py`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from replay.errors import UsageError
from replay.integrations.vllm.engines import Engines
from replay.replayer import Plant
from replay.replayer.tolerance import CROSS_HARDWARE_ATOL
from replay.trainer.figures import Bin, Bucket, Figures, by_position, figures, histogram
from replay.trainer.forward import check_device, load_model, teacher_forced
from replay.trainer.layers import TrainerLayers, check_against, trainer_layers
from replay.trainer.rollouts import Rollout, Rollouts, read_rollouts
from replay.trainer.routing import RoutingAgreement, RoutingTally
from replay.trainer.semantics import Semantics, like_vllm, semantics, trainer_logprobs


@dataclass(frozen=True)
class TrainerOptions:
    """How the trainer scores: its checkpoint (default: the recording's), dtype (default: the recording's),
    attention and micro-batch; which requests; the clip C; how many worst tokens to show."""

    model: str | None = None
    dtype: str | None = None
    attention: str = "sdpa"
    micro_batch: int = 8
    requests: list[str] | None = None
    pack: bool = False  # each micro-batch packed into one row instead of right-padded
    clip: float = 2.0
    worst: int = 5
    bisect: bool = False  # then the module where the two part, at `token` (default: the worst token)
    token: tuple[str, int] | None = None  # (request, output position)
    plant: Plant | None = None  # a fault on the replay side of the bisect
    runner: str | None = None  # the replay side of the bisect (default: the capture's engine's runner)
    dump: str | None = None  # the bisect's module outputs, both sides
    against: str = "transformers"  # the bisect's trainer side: the trainer's forward, or "builtin" (our runner)
    device: str = "cpu"  # where the trainer's forward runs (cuda: as the trainer runs it)


class WorstToken(msgspec.Struct):
    """One token where the trainer and vLLM part most, with where vLLM computed it."""

    request: str
    position: int  # output position
    step: int
    batch_requests: int  # the requests, and tokens, of that step's batch
    batch_tokens: int
    token: int
    trainer: float  # the trainer's like-for-like value
    vllm: float
    delta: float


class RequestScore(msgspec.Struct, omit_defaults=True):
    """One rollout's comparison."""

    request: str
    tokens: int
    compared: int = 0
    mean_abs: float = 0.0
    max_abs: float = 0.0
    clipped: int = 0
    set_aside: str = ""  # why it is not compared
    semantics: str = ""  # how vLLM's number differs in meaning from the trainer's logprob
    semantic_gap: float = 0.0  # max |trainer's logprob - its like-for-like value|: that difference, not counted


class TrainerReport(msgspec.Struct):
    """The answer of `replay trainer`. Δ = the trainer's like-for-like value - vLLM's."""

    capture: str
    model: str
    dtype: str
    attention: str
    micro_batch: int
    pack: bool
    logprobs_mode: str
    verdict: str
    rounding: bool  # every compared Δ within the dtype's rounding tolerance
    tolerance: float
    units: str  # "logprob", or "logit" where vLLM returned logits (its *_logits modes)
    overall: Figures  # like for like
    # the trainer's whole-vocabulary log_softmax(logits / T) against vLLM's numbers, semantics and all: what a
    # trainer that compares them naively logs (None where every request's numbers mean the same as the trainer's)
    as_trainer: Figures | None
    by_position: list[Bucket]
    histogram: list[Bin]  # |Δ| by decade, like for like
    worst: list[WorstToken]
    requests: list[RequestScore]
    notes: list[str] = []
    routing: RoutingAgreement | None = None  # where the capture kept MoE routing: the trainer's router against it
    layers: TrainerLayers | None = None  # with `bisect`: the module where they part
    device: str = "cpu"  # where the trainer's forward ran
    data_lost: list[str] = []  # what the capture lost: the sequences it cut are scored up to there


def score_capture(path: str | os.PathLike, opts: TrainerOptions | None = None, *,
                  engines: Engines | None = None, hook: Callable[[Any], None] | None = None) -> TrainerReport:
    """Score every rollout of capture `path` with the trainer's forward against what vLLM returned, like for like,
    with the figures RL teams log. `engines`: started vLLM engines the bisect may run on (else it starts its own).
    `hook(model)`: called on the trainer's model once loaded (a test plants a trainer-side fault with it)."""
    opts = opts or TrainerOptions()
    if opts.micro_batch < 1 or opts.clip <= 0:
        raise UsageError("--micro-batch must be at least 1 and --clip above 0")
    if opts.dump is not None and not opts.bisect:
        raise UsageError("--dump needs --bisect: it writes the bisect's module outputs")
    check_against(opts.against)
    check_device(opts.device)
    data = read_rollouts(path, opts.requests)
    header = data.header
    mode = header.engine_config.logprobs_mode
    model_id = header.model
    model_path = opts.model or (model_id.location() if model_id else "")
    if opts.model and not os.path.isdir(opts.model):
        raise UsageError(f"--model {opts.model}: not a checkpoint here (a directory with the trainer's config and "
                         "weights)")
    if not model_path or not os.path.isdir(model_path):
        raise UsageError(f"{path}: the recording's model {model_path or '(unnamed)'} is not a checkpoint here: "
                         "give the trainer's with --model PATH")
    dtype = opts.dtype or (model_id.dtype if model_id and model_id.dtype else "float32")
    if opts.requests is not None:
        _check_named(path, opts.requests, data)
    notes = _checkpoint_notes(model_path, model_id, dtype)
    model = load_model(model_path, dtype, opts.attention, opts.device)

    scores: dict[str, RequestScore] = {}
    deltas: list[np.ndarray] = []
    naive: list[np.ndarray] = []
    compared: list[WorstToken] = []
    meaning = {r.name: semantics(r.params, mode) for r in data.rollouts}
    for r in data.rollouts:
        why = meaning[r.name].set_aside or ("" if r.params.logprobs is not None and any(v is not None for v in r.values)
                                            else "it asked for no logprobs, so vLLM returned none")
        if not r.prompt:
            why = "its prompt has no token ids (prompt embeddings): a trainer has no sequence to score"
        if why:
            scores[r.name] = RequestScore(r.name, len(r.tokens), set_aside=why)
    if hook is not None:
        hook(model)
    tally = RoutingTally()
    forwarded = [r for r in data.rollouts if r.prompt and (r.name not in scores or r.routing)]
    for r, z, experts in teacher_forced(model, forwarded, opts.micro_batch, opts.pack):
        if r.routing and experts is not None:
            tally.add(r.name, r.routing, experts)
        if r.name in scores:
            continue
        scores[r.name], d, gap_d, tokens = _compare(r, z, meaning[r.name], data.batches, opts.clip)
        deltas.append(d)
        if gap_d is not None:
            naive.append(gap_d)
        compared += tokens
    # the verdict and the bisect take the worst compared token, whatever --worst asks to print
    compared.sort(key=lambda w: -abs(w.delta))
    top = compared[0] if compared else None
    worst = compared[:opts.worst]
    logits = mode.endswith("_logits")
    overall = figures(deltas, opts.clip, logprobs=not logits)
    # the coarser of the two sides' dtypes: a float32 trainer cannot agree with bfloat16 numbers beyond bfloat16's
    tol = max(CROSS_HARDWARE_ATOL.get(d, CROSS_HARDWARE_ATOL["float32"])
              for d in {dtype, model_id.dtype if model_id and model_id.dtype else dtype})
    rounding = overall.max_abs <= tol
    ordered = [scores[r.name] for r in data.rollouts]
    differs = any(x.semantics and x.semantic_gap for x in ordered)
    units = "logit" if logits else "logprob"
    res = TrainerReport(str(path), model_path, dtype, opts.attention, opts.micro_batch, opts.pack, mode,
                        _verdict(overall, top, tol, rounding, ordered, units), rounding, tol, units, overall,
                        figures(naive, opts.clip) if differs else None, by_position(deltas), histogram(deltas),
                        worst, ordered, notes, tally.result(), device=opts.device, data_lost=data.lost)
    if opts.bisect:
        res.layers = _bisect(path, opts, top, model_path, dtype, engines, model)
    return res


def _bisect(path, opts: TrainerOptions, top: WorstToken | None, model_path: str, dtype: str,
            engines: Engines | None, model: Any) -> TrainerLayers:
    """The module where the trainer and the replay part, at `opts.token` or the worst compared token `top`, on the
    model the scoring loaded."""
    if opts.token is None and top is None:
        raise UsageError("--bisect: no token was compared; name one with --token REQUEST:POSITION")
    request, position = opts.token or (top.request, top.position)
    own = engines or Engines(keep=1)
    try:
        return trainer_layers(path, request, position, model_path=model_path, dtype=dtype,
                              attention=opts.attention, runner=opts.runner, plant=opts.plant, engines=own,
                              dump=opts.dump, model=model, against=opts.against, device=opts.device)
    finally:
        if own is not engines:
            own.close()


def _compare(r: Rollout, z: torch.Tensor, s: Semantics, batches: dict[int, tuple[int, int]], clip: float
             ) -> tuple[RequestScore, np.ndarray, np.ndarray | None, list[WorstToken]]:
    """One rollout against vLLM's numbers: its score, Δ per compared token, the trainer's own logprob minus vLLM's
    (None where vLLM returned logits), and every compared token as a `WorstToken` candidate."""
    at, tok = torch.arange(len(r.tokens), device=z.device), torch.tensor(r.tokens, device=z.device)
    like = like_vllm(z, s)[at, tok].double().cpu().numpy()
    mine = trainer_logprobs(z, s)[at, tok].double().cpu().numpy()
    keep = [i for i, v in enumerate(r.values) if v is not None]
    vllm = np.array([r.values[i] for i in keep])
    d = like[keep] - vllm
    gap = float(np.abs(mine[keep] - like[keep]).max()) if s.differs and not s.logits else 0.0
    score = RequestScore(r.name, len(r.tokens), len(keep), float(np.abs(d).mean()), float(np.abs(d).max()),
                         0 if s.logits else int((np.exp(d) > clip).sum()), semantics=s.differs, semantic_gap=gap)
    tokens = [WorstToken(r.name, i, r.steps[i], *batches.get(r.steps[i], (0, 0)), r.tokens[i], float(like[i]),
                         float(r.values[i]), float(d[j])) for j, i in enumerate(keep)]
    return score, d, None if s.logits else mine[keep] - vllm, tokens


def _checkpoint_notes(path: str, recorded, dtype: str) -> list[str]:
    """What differs between the recording's model and the trainer's: the weights, the dtype."""
    from replay.provenance.weights import checkpoint_fingerprint

    notes = []
    if recorded is not None and recorded.fingerprint:
        try:
            mine = checkpoint_fingerprint(path)
        except (OSError, ValueError):
            mine = ""
        if mine and mine != recorded.fingerprint:
            notes.append(f"the trainer's weights ({path}) are not the recording's: expect more than numerics")
    if recorded is not None and recorded.dtype and recorded.dtype != dtype:
        notes.append(f"dtype: vLLM computed in {recorded.dtype}, the trainer in {dtype}")
    return notes


def _check_named(path, names: list[str], data: Rollouts) -> None:
    """Refuse `--request` names that cannot be compared: one that generated no token (naming the sequences of an
    n > 1 request named by its parent's id), one that asked for no logprobs."""
    if not data.rollouts:
        raise UsageError(data.none_generated(path, names))
    quiet = [r.name for r in data.rollouts if r.params.logprobs is None or all(v is None for v in r.values)]
    if quiet:
        raise UsageError(f"--request {', '.join(quiet)}: recorded no logprobs (the request asked for none), so there "
                         "is nothing to compare: record it with logprobs")


def _verdict(f: Figures, top: WorstToken | None, tol: float, rounding: bool, scores: list[RequestScore],
             units: str) -> str:
    """One line: agree at the rounding level, or where they part most, and what a clip would touch."""
    aside = sum(1 for s in scores if s.set_aside)
    tail = f" ({aside} request(s) set aside)" if aside else ""
    if not f.tokens:
        return "nothing to compare: no request returned logprobs" + tail
    clip = ("" if f.k3 is None else f"; no token would be clipped at C={f.clip:g}" if not f.clipped_tokens else
            f"; a clip at C={f.clip:g} would touch {f.clipped_tokens} token(s) "
            f"({100 * f.clipped_tokens / f.tokens:.2g} %) in {f.clipped_sequences} of {f.sequences} sequence(s)")
    head = (f"the trainer and vLLM agree at the rounding level (max |Δ{units}| {f.max_abs:.3g} <= {tol:g}) over "
            f"{f.tokens} tokens of {f.sequences} sequence(s)" if rounding else
            f"the trainer and vLLM part beyond the rounding level ({tol:g}): max |Δ{units}| {f.max_abs:.3g} at "
            f"request {top.request}, position {top.position} (step {top.step}, a batch of "
            f"{top.batch_requests}), mean {f.mean_abs:.3g} over {f.tokens} tokens")
    return f"{head}{clip}{tail}"
