"""`top_p_dropped`: which tokens top-p drops, as vLLM's sampler decides it, without sorting the vocabulary when the
answer is plain from the most likely tokens.

vLLM (and `filtered`) sort a row ascending, take the softmax's cumulative sum and drop the tokens whose sum is at most
`1 - top_p`, the most likely always kept. Sorting 151,936 logits takes ~10 ms of CPU a row, which was most of the
trainer's like-for-like pass (docs/performance.md, "The trainer's like-for-like pass"). What the sort decides is a
count: the m most likely tokens stay, m being the first rank whose mass above it reaches `top_p`. The top K tokens
alone give that mass (`torch.topk`, in float64 against the row's log-sum-exp), and decide a row when its boundary
sits among them, clear of `top_p` by `MARGIN` on both sides, with no tie of logits across it. (The sort's float32
cumulative sum is ~1e-7 off at this size, far under MARGIN.) Every other row is sorted as vLLM sorts it, so either
way the mask is the sort's.
"""

from __future__ import annotations

import torch

TOPS = (1024, 16384)  # how many of the most likely tokens are looked at, then again for the rows they left open
MARGIN = 1e-3  # how far from top_p the mass at the boundary must be for the short path to decide it


def top_p_dropped(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] bool: True where top-p drops the token of `x` [..., V] (logits after temperature, -inf where
    already dropped)."""
    rows = x.reshape(-1, x.shape[-1])
    dropped = torch.empty(rows.shape, dtype=torch.bool, device=x.device)
    wider = torch.arange(len(rows), device=x.device)  # rows the next, wider look may decide
    sort = [wider[:0]]  # rows no look decides: a boundary too close to top_p or tied, or beyond every look
    tops = [k for k in TOPS if k < rows.shape[-1]]
    # (float32 and float64 rows only: in a half type the sort's own sums are too coarse to decide by mass)
    if 0 < top_p and rows.shape[-1] > 1 and len(rows) and tops and rows.dtype in (torch.float32, torch.float64):
        lse = torch.logsumexp(rows, dim=-1, keepdim=True).double()
        # float32 holds a log-sum-exp under 100 to ~4e-6, which moves a mass far less than MARGIN; logits / T reach
        # 1e5 at a near-greedy temperature, where one float32 step is ~0.01: those rows' sums are taken about their
        # maximum
        big = (lse.abs() > 100).flatten().nonzero().flatten()
        if len(big):
            top = rows[big].amax(dim=-1, keepdim=True)
            lse[big] = top.double() + torch.logsumexp(rows[big] - top, dim=-1, keepdim=True).double()
        for k, wide in zip(tops, [*tops[1:], 0]):
            decided, wider_may, masks = _short(rows[wider], lse[wider], k, wide, top_p)
            dropped[wider[decided]] = masks
            sort.append(wider[~decided & ~wider_may])
            wider = wider[wider_may]
    rest = torch.cat([*sort, wider])
    if len(rest):
        dropped[rest] = _sorted(rows[rest], top_p)
    return dropped.reshape(x.shape)


def _sorted(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """vLLM's own decision: [R, V] bool."""
    sorted_x, order = torch.sort(x, dim=-1, descending=False)
    cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - top_p
    drop[:, -1] = False  # always keep the most likely token
    return torch.zeros_like(drop).scatter(-1, order, drop)


def _short(x: torch.Tensor, lse: torch.Tensor, k: int, wide: int, top_p: float
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the top `k` of rows `x` [R, V] decide (their log-sum-exp `lse` [R, 1]): the rows they decide [R] bool,
    the rows a look at the top `wide` may decide [R] bool (0: no such look), and the decided rows' masks
    [decided, V]."""
    values, ids = torch.topk(x, k, dim=-1)  # [R, k], most likely first
    p = (values.double() - lse).exp()
    above = p.cumsum(dim=-1) - p  # [R, k]: the mass of the tokens ranked above each (it never falls)
    m = (above < top_p).sum(dim=-1)  # kept: the m most likely tokens
    beyond = m >= k
    last, first = (m - 1).clamp(0, k - 1)[:, None], m.clamp(max=k - 1)[:, None]
    decided = (~beyond & (top_p - above.gather(1, last)[:, 0] > MARGIN)
               & (above.gather(1, first)[:, 0] - top_p > MARGIN)
               & (values.gather(1, last)[:, 0] != values.gather(1, first)[:, 0]))
    # a wider look only where the top k hold half of top_p: a flat row's boundary lies far beyond any (that row
    # goes to the sort; whichever way a row goes, its mask is the sort's)
    wider = beyond & (wide > k) & (above[:, -1] + p[:, -1] >= top_p / 2)
    keep = torch.arange(k, device=x.device)[None, :] < m[decided][:, None]  # [decided, k]
    masks = torch.ones((int(decided.sum()), x.shape[-1]), dtype=torch.bool, device=x.device).scatter(
        -1, ids[decided], ~keep)
    return decided, wider, masks
