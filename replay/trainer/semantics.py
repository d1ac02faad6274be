"""What the number vLLM returned for a sampled token means, and the same quantity computed from a trainer's logits.

vLLM's sampler (v1) returns, per `logprobs_mode`:
- `raw_logprobs` (the default): `log_softmax(z)` of the model's logits `z`, before temperature, penalties and
  top-k/top-p;
- `processed_logprobs`: `log_softmax` after penalties, temperature (`z / T`; greedy rows at T = 1), min-p and
  top-k/top-p (tokens outside the kept set at -inf, the kept ones renormalised);
- `raw_logits`: the model's logits `z`;
- `processed_logits`: `z / T` after penalties, the tokens top-k/top-p/min-p drop at -inf (nothing renormalised: a
  sampled token's is its `z / T`).

A trainer scores `log_softmax(z / T)` over the whole vocabulary. Where vLLM's number means something else (raw
logprobs of a tempered request, processed logprobs renormalised after top-p), the difference is one of *semantics*:
computed on the trainer's side alone, named, and never counted as numerics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replay.contracts import SAMPLING_EPS, SamplingParams
from replay.engine.config import LOGPROBS_MODES
from replay.engine.sampler import filtered


@dataclass(frozen=True)
class Semantics:
    """One request's comparison: what vLLM's number is, and how it differs from the trainer's logprob."""

    mode: str  # vLLM's logprobs_mode
    temperature: float  # the trainer's: the request's, 1 for a greedy request
    top_k: int  # 0: off (applied only where vLLM's number is processed)
    top_p: float
    min_p: float
    params: SamplingParams
    set_aside: str = ""  # why nothing of this request is comparable ("" when it is)
    differs: str = ""  # how vLLM's number differs in meaning from the trainer's ("" when it is the same quantity)

    @property
    def logits(self) -> bool:
        """vLLM returned logits, not logprobs."""
        return self.mode.endswith("_logits")


def semantics(params: SamplingParams, mode: str) -> Semantics:
    """The comparison for a request with `params` under vLLM's `mode`."""
    greedy = params.temperature < SAMPLING_EPS
    t = 1.0 if greedy else params.temperature
    k = 0 if greedy or params.top_k in (0, -1) else params.top_k
    p = 1.0 if greedy else params.top_p
    mp = 0.0 if greedy else params.min_p
    processed = mode.startswith("processed")
    if mode not in LOGPROBS_MODES:
        return Semantics(mode, t, k, p, mp, params, set_aside=f"logprobs mode {mode!r} is not one vLLM offers")
    if params.structured_outputs:
        return Semantics(mode, t, k, p, mp, params,
                         set_aside="a grammar masked the logits vLLM scored; a trainer scores them unmasked")
    penalised = [name for name, on in (("repetition_penalty", params.repetition_penalty != 1.0),
                                       ("presence_penalty", params.presence_penalty != 0.0),
                                       ("frequency_penalty", params.frequency_penalty != 0.0),
                                       ("logit_bias", bool(params.logit_bias)),
                                       ("allowed_token_ids", bool(params.allowed_token_ids)),
                                       ("bad_words", bool(params.bad_words)), ("min_tokens", params.min_tokens > 0))
                 if on]
    if processed and penalised:
        why = f"{', '.join(penalised)} changed the logits before vLLM's processed logprobs; the trainer does not"
        return Semantics(mode, t, k, p, mp, params, set_aside=why)
    gaps = []
    before = " and ".join(x for x in (f"temperature {t:g}" if t != 1.0 else "", _masks(k, p, mp)) if x)
    if mode.startswith("raw") and before:
        gaps.append(f"vLLM's raw numbers come before {before}")
    if mode == "processed_logprobs" and (k or p < 1.0 or mp > 0.0):  # processed logits keep the sampled one's z / T
        gaps.append("vLLM's are renormalised over the tokens " + _masks(k, p, mp) + " keeps (the renormalisation "
                    "bias)")
    if mode.endswith("_logits"):
        gaps.append("vLLM returned logits, not logprobs (compared as logits)")
    return Semantics(mode, t, k, p, mp, params, differs="; ".join(gaps))


def _masks(k: int, p: float, mp: float) -> str:
    return " and ".join(x for x in (f"top-k {k}" if k else "", f"top-p {p:g}" if p < 1.0 else "",
                                    f"min-p {mp:g}" if mp > 0.0 else "") if x)


def trainer_logprobs(z: torch.Tensor, s: Semantics) -> torch.Tensor:
    """[G, V] what a trainer scores: log_softmax(z / T) over the whole vocabulary (z: float32 logits)."""
    return torch.log_softmax(z / s.temperature, dim=-1)


ROWS = 64  # rows `like_vllm` filters at once


def like_vllm(z: torch.Tensor, s: Semantics) -> torch.Tensor:
    """[G, V] vLLM's quantity (its `logprobs_mode`, this request's parameters) computed from the trainer's logits,
    processed as the builtin engine's sampler processes a row (vLLM's order: temperature, min-p, top-k, top-p)."""
    if s.mode.startswith("raw") or s.params.temperature < SAMPLING_EPS:
        return z if s.logits else torch.log_softmax(z, dim=-1)
    # rows a block at a time: filtering holds a few [rows, V] temporaries (a sort's indices are 8 bytes a logit)
    x = torch.cat([filtered(block, s.params) for block in z.split(ROWS)]) if len(z) else z
    return x if s.logits else torch.log_softmax(x, dim=-1)
