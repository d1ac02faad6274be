"""Verification of scheduled draft tokens (speculative decoding), with vLLM's rejection-sampling semantics
(`vllm/v1/sample/rejection_sampler.py`, the "standard" method).

A request verifying k drafts has k + 1 logits rows: row p scores the position after draft p - 1 (row 0 the one
after the last known token). Each row is processed as the sampler processes a row (`sampler.process`), with the
drafts before it counted as output (penalties, min_tokens), then:
- greedy: accept draft p while it is the row's argmax; the first row whose argmax differs emits that argmax and
  ends the request's step; when every draft is accepted, row k's argmax is the bonus token;
- random: accept draft p with probability P_p(draft) (ngram and other proposers without draft probabilities count
  the draft as certain, q = 1, as vLLM does), else draw the recovered token from P_p with the draft removed and
  stop; the bonus token is a draw from P_k. Draws come from the request's generator: the builtin engine's
  streams, not vLLM's, so a vLLM capture's random verifications are not compared (the replay says so).
Logprobs are the raw ones (before processing) of each emitted token, one row per emitted token, with the rows
of each request located by `cu_num_generated_tokens` (`[num_reqs + 1]`), as vLLM's `parse_output` lays them out.
A request that is not drawing (a partial prefill chunk) emits nothing but keeps one logprob row, as in vLLM.
"""

from __future__ import annotations

import torch

from replay.contracts import SAMPLING_EPS, Array, LogprobsLists
from replay.engine.sampler import SampleRow, filtered, logprob_rows, process, race


def _row_at(row: SampleRow, drafts: list[int], p: int) -> SampleRow:
    """`row` as the sampler sees position p: the drafts before it are output already."""
    if p == 0:
        return row
    return SampleRow(row.params, row.generator, row.prompt_token_ids, row.output_token_ids + drafts[:p],
                     row.stop_token_ids, row.draw, row.vllm_draw)


def _verify(logits: torch.Tensor, row: SampleRow, drafts: list[int]) -> list[int]:
    """Tokens one request emits from its k + 1 rows of `logits` (see the module docstring)."""
    greedy = row.params.temperature < SAMPLING_EPS
    out: list[int] = []
    for p in range(len(drafts) + 1):
        x = process(logits[p], _row_at(row, drafts, p))
        if greedy:
            tok = int(x.argmax())
            out.append(tok)
            if p == len(drafts) or tok != drafts[p]:
                return out
            continue
        probs = torch.softmax(filtered(x, row.params), dim=-1)
        if p == len(drafts):  # every draft accepted: the bonus token
            out.append(race(probs, row.generator))
            return out
        d = drafts[p]
        u = float(torch.rand((), generator=row.generator))
        if u < float(probs[d]):
            out.append(d)
            continue
        rest = probs.clone()
        rest[d] = 0.0
        out.append(race(rest / rest.sum() if float(rest.sum()) > 0 else probs, row.generator))
        return out
    return out


def verify_drafts(logits: torch.Tensor, rows: list[SampleRow], drafts: list[list[int]],
                  num_logprobs: int) -> tuple[list[list[int]], LogprobsLists | None]:
    """Per request (in batch order): the tokens it emits, and the logprob rows of those tokens (or None when no
    request asked for logprobs: `num_logprobs` < 0). `logits` holds 1 + len(drafts[i]) consecutive rows per
    request."""
    logits = logits.float()
    sampled: list[list[int]] = []
    flat_rows: list[int] = []  # logits row of every emitted (or discarded) token
    flat_tokens: list[int] = []
    cu = [0]
    first = 0
    for row, d in zip(rows, drafts):
        if row.draw:
            toks = _verify(logits[first:first + len(d) + 1], row, d)
            sampled.append(toks)
        else:  # a partial prefill chunk: nothing emitted; its (discarded) token keeps a logprob row
            toks = [int(process(logits[first], row).argmax())]
            sampled.append([])
        flat_rows.extend(range(first, first + len(toks)))
        flat_tokens.extend(toks)
        cu.append(cu[-1] + len(toks))
        first += len(d) + 1
    if num_logprobs < 0:
        return sampled, None
    raw = torch.log_softmax(logits[torch.tensor(flat_rows, dtype=torch.long)], dim=-1)
    res = logprob_rows(raw, flat_tokens, num_logprobs)
    return sampled, LogprobsLists(Array.from_torch(res.logprob_token_ids), Array.from_torch(res.logprobs),
                                  Array.from_torch(res.ranks), cu)
