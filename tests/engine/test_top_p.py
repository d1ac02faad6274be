"""top_p_dropped against vLLM's sort at a real vocabulary (151,936 ids): the short path decides the rows it can
and gives the sort's mask; the rows it cannot (a boundary close to top_p, tied logits across it, a flat row) go to
the sort."""

import pytest
import torch

from replay.contracts import SamplingParams
from replay.engine import top_p
from replay.engine.sampler import filtered
from replay.engine.top_p import MARGIN, TOPS, _short, _sorted, top_p_dropped
from testbed.logits import QWEN_VOCAB, peaked_logits

V = QWEN_VOCAB


@pytest.mark.parametrize("p", [0.5, 0.9, 0.95])
def test_the_short_path_gives_the_sorts_mask(p):
    z = peaked_logits(24, 0) / 0.7
    lse = torch.logsumexp(z, dim=-1, keepdim=True).double()
    decided, wider, masks = _short(z, lse, TOPS[0], TOPS[1], p)
    assert decided.sum() >= 12, "peaked rows are what the short path is for"  # (the rest: close to p, or beyond)
    assert torch.equal(masks, _sorted(z[decided], p))
    assert torch.equal(top_p_dropped(z, p), _sorted(z, p))


def test_rows_it_cannot_decide_go_to_the_sort():
    flat = torch.randn((4, V), generator=torch.Generator().manual_seed(1))  # the boundary lies past 16,384 ids
    tied = peaked_logits(1, 2)
    tied[0, :2] = 30.0  # the two most likely tied, at ~0.5 each: at top_p 0.3 the boundary falls between them
    # a row whose boundary mass sits 4e-4 from top_p: within MARGIN, so float32 rounding is not ruled out
    near = torch.full((1, V), -30.0)
    near[0, :3] = torch.log(torch.tensor([0.5, 0.3004, 0.1996]))
    assert MARGIN > 4e-4
    cases = [(flat, 0.9), (tied, 0.3), (near, 0.8)]
    for x, p in cases:
        lse = torch.logsumexp(x, dim=-1, keepdim=True).double()
        decided, wider, _ = _short(x, lse, TOPS[0], TOPS[1], p)
        assert not decided.any() and not wider.any()  # (a flat row's 16,384 most likely cannot reach 0.9 either)
        assert torch.equal(top_p_dropped(x, p), _sorted(x, p))


def test_rows_with_tokens_already_dropped():
    """After top-k (or a grammar's mask) most of a row is -inf: the boundary can sit on the last finite token."""
    z = peaked_logits(8, 3)
    z = z.masked_fill(z < torch.topk(z, 20).values[:, -1:], float("-inf"))
    for p in (0.8, 0.99, 0.999, 0.99999):
        assert torch.equal(top_p_dropped(z, p), _sorted(z, p))


def test_filtered_rows_at_once_equal_one_at_a_time(monkeypatch):
    """The trainer filters a block of rows at once, the builtin sampler one row: the same bits either way, and the
    same as with the sort alone."""
    z = torch.cat([peaked_logits(6, 4), torch.randn((2, V), generator=torch.Generator().manual_seed(5))])
    for params in (SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.9, min_p=0.05, top_p=0.8),
                   SamplingParams(temperature=0.7, top_k=50, top_p=0.95)):
        block = filtered(z, params)
        assert torch.equal(block, torch.stack([filtered(row, params) for row in z]))
        monkeypatch.setattr(top_p, "TOPS", ())
        assert torch.equal(block, filtered(z, params))
        monkeypatch.undo()


def test_a_near_greedy_temperature_is_decided_as_the_sort_decides_it():
    """logits / T reach 7e4 at T = 0.001, where one float32 step is ~0.008: the masses are taken about the row's
    maximum, and a boundary 0.0007 from top_p still goes to the sort."""
    x = torch.full((V,), 10.0)
    x[3], x[5] = 70.0, 70.0 - 0.0021797  # the most likely holds 0.8984 of the mass
    params = SamplingParams(temperature=0.001, top_p=0.8977)
    assert torch.isfinite(filtered(x, params)).sum() == 1
    for magnitude in (4e4, 2e5, 1e6):
        for p in (0.5, 0.8977, 0.95):
            z = torch.full((3, V), magnitude - 200)
            z[:, 3] = magnitude
            z[:, 5] = magnitude - torch.tensor([0.01, 1.0, 3.0])
            assert torch.equal(top_p_dropped(z, p), _sorted(z, p))


def test_half_precision_rows_are_sorted():
    z = peaked_logits(4, 6).to(torch.bfloat16)
    assert torch.equal(top_p_dropped(z, 0.9), _sorted(z, 0.9))
