"""Twins (`replay.diff.twins`): which requests are twins, and where two recorded outputs part."""

from __future__ import annotations

import numpy as np

from replay.capture import RequestAdded
from replay.contracts import EngineCoreRequest, SamplingParams
from replay.diff.rules import Row
from replay.diff.twins import part, prompt_part, twin_key


def _arrival(prompt: list[int], **sp) -> RequestAdded:
    return RequestAdded(0, EngineCoreRequest("r", prompt, None, SamplingParams(**sp), None, 0.0, None, None, None))


def test_twins_share_what_decides_each_token_not_when_they_stop_or_what_they_return():
    greedy = twin_key(_arrival([1, 2, 3], temperature=0.0, max_tokens=10, logprobs=3))
    for same in ({"max_tokens": 6}, {"logprobs": 5}, {"seed": 7}, {"temperature": 1e-6}, {"stop": ["x"]},
                 {"stop_token_ids": [5]}, {"ignore_eos": True}, {"prompt_logprobs": 2}, {"n": 2}):
        assert twin_key(_arrival([1, 2, 3], **{"temperature": 0.0, "max_tokens": 10, "logprobs": 3, **same})) == greedy
    for other in ({"repetition_penalty": 1.2}, {"logit_bias": {4: 1.0}}, {"top_k": 5},
                  {"min_tokens": 2, "stop_token_ids": [5]}):
        assert twin_key(_arrival([1, 2, 3], **{"temperature": 0.0, **other})) != greedy, other
    assert twin_key(_arrival([1, 2, 4], temperature=0.0)) != greedy
    # a random request is a twin only with its seed: unseeded, its draws differ by design
    assert twin_key(_arrival([1, 2, 3], temperature=0.8)) is None
    seeded = twin_key(_arrival([1, 2, 3], temperature=0.8, seed=1, max_tokens=4))
    assert seeded == twin_key(_arrival([1, 2, 3], temperature=0.8, seed=1, max_tokens=9))
    assert seeded != twin_key(_arrival([1, 2, 3], temperature=0.8, seed=2))


def test_rows_as_wide_as_their_batch_part_only_over_the_columns_both_hold():
    """vLLM returns as many top-k (and prompt top-k) columns as the batch's largest request asks for: twins whose
    batches asked for 20 and 5 hold the same numbers in the first 5, and did not answer differently."""
    ids, vals = np.arange(100, 121, dtype=np.int32), -10.0 - 0.01 * np.arange(21, dtype=np.float32)
    wide, narrow = Row(ids, vals, 3), Row(ids[:6], vals[:6], 3)
    assert part([(0, 7, wide)], [(5, 7, narrow)]) is None
    moved = Row(np.concatenate([ids[:5], [999]]).astype(np.int32), vals[:6], 3)
    assert part([(0, 7, wide)], [(5, 7, moved)])[:2] == (0, "logprobs")
    a = np.stack([np.tile(ids.astype(np.float64), (4, 1)), np.tile(vals.astype(np.float64), (4, 1))])
    assert prompt_part(a, a[:, :, :6]) is None
    b = a[:, :, :6].copy()
    b[1, 2, 3] += 0.5
    assert prompt_part(a, b) == (3, "prompt_logprobs", 0.5)
