"""Structured output at replay: the recorded grammar bitmask applied to the logits, as vLLM's `sample_tokens` does.

vLLM's scheduler asks the grammar backend (xgrammar, guidance, ...) which tokens each structured-output request may
take next and packs the answer into int32 words: token t is allowed iff bit t % 32 of word t // 32 is set. The
runner sets every other logit to -inf before the sampler (so logprobs see the mask too). A replay needs only the
recorded mask, never the grammar.
"""

from __future__ import annotations

import torch

from replay.contracts import GrammarOutput


def allowed_tokens(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] bool from one packed row ([ceil(vocab / 32)] int32)."""
    bits = torch.arange(32, dtype=torch.int64)
    words = bitmask_row.to(torch.int64) & 0xFFFFFFFF  # the sign bit is token 31 of the word, not a sign
    return ((words[:, None] >> bits) & 1).bool().reshape(-1)[:vocab]


def apply_grammar_bitmask(logits: torch.Tensor, rows: dict[str, int], grammar: GrammarOutput[str] | None,
                          drafts: dict[str, list[int]] | None = None) -> None:
    """In place: -inf for every token the grammar forbids, on the rows of structured-output requests.
    `rows[req_id]` = the request's first logits row; a request verifying k drafts (`drafts`) has k + 1 rows, and
    the bitmask k + 1 rows for it in the same order, as vLLM lays them out (`structured_output.utils`). Rows of
    requests absent from the grammar output are untouched."""
    if grammar is None:
        return
    mask = grammar.grammar_bitmask.to_torch()
    drafts = drafts or {}
    j = 0
    for rid in grammar.structured_output_request_ids:
        count = 1 + len(drafts.get(rid, ()))
        i = rows.get(rid)
        if i is not None:
            for k in range(count):
                logits[i + k].masked_fill_(~allowed_tokens(mask[j + k], logits.shape[-1]), float("-inf"))
        j += count
