"""The recorded structured-output bitmask applied at replay (vLLM's packing: bit t % 32 of int32 word t // 32)."""

from __future__ import annotations

import numpy as np
import torch

from replay.contracts import Array, GrammarOutput
from replay.engine.grammar import allowed_tokens, apply_grammar_bitmask


def _mask(allowed: set[int], vocab: int) -> np.ndarray:
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words.view(np.int32)  # vLLM's dtype: token 31 of a word is its sign bit


def test_allowed_tokens_unpacks_every_bit_including_the_sign_bit():
    allowed = {0, 5, 31, 32, 63, 64, 99}
    got = allowed_tokens(torch.from_numpy(_mask(allowed, 100)), 100)
    assert got.shape == (100,) and set(torch.nonzero(got).flatten().tolist()) == allowed


def test_apply_masks_only_the_structured_rows():
    logits = torch.randn(3, 70)
    before = logits.clone()
    go = GrammarOutput(["b"], Array.from_numpy(_mask({3, 40}, 70)[None, :]))
    apply_grammar_bitmask(logits, {"a": 0, "b": 1, "c": 2}, go)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = torch.isfinite(logits[1])
    assert set(torch.nonzero(finite).flatten().tolist()) == {3, 40}
    assert torch.equal(logits[1][finite], before[1][[3, 40]])


def test_a_request_verifying_drafts_takes_one_bitmask_row_per_position_as_vllm_lays_them_out():
    """Request "a" verifies 2 drafts (logits rows 0-2, bitmask rows 0-2); "b" follows with one row each."""
    logits = torch.randn(4, 70)
    masks = np.stack([_mask({1}, 70), _mask({2}, 70), _mask({3}, 70), _mask({4, 5}, 70)])
    go = GrammarOutput(["a", "b"], Array.from_numpy(masks))
    apply_grammar_bitmask(logits, {"a": 0, "b": 3}, go, {"a": [9, 9]})
    assert [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits] == [{1}, {2}, {3}, {4, 5}]


def test_no_grammar_output_leaves_logits_alone():
    logits = torch.randn(2, 10)
    before = logits.clone()
    apply_grammar_bitmask(logits, {"a": 0, "b": 1}, None)
    assert torch.equal(logits, before)
