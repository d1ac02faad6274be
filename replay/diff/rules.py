"""The diff's rules, each defined once: when two logprobs are equal, how far apart two top-k rows are, the
top1-top2 margin, and whether a token flip is a tie flip or a confident one.

A token flip at a near-tie (the top1-top2 margin below `tie_margin`) is a *tie flip*: numerics noise made visible.
A flip at a large margin is a *confident flip*: something is wrong (wrong KV block, wrong position, a bug). A
random-sampling request's flip is a *draw*: a margin says nothing about a random sample; with its logprobs equal
within the tolerance it is the same distribution, another draw (the sampler changed, not the numerics).
"Near" means below `tie_margin`, or within twice the logprob noise measured at the same position.
Tolerances default to bitwise (`atol = rtol = 0`); vLLM's own tests compare scheduling modes with rtol 1e-3 and
atol 1e-6. Under a tolerance two rows are equal when every logprob both hold is within it (`compare_rows`): a rank
or top-k order that moved among values within the tolerance is a *near-tie*, counted, never a divergence. Bitwise,
any moved rank or order is a difference, and is named as one.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import numpy as np

from replay.contracts import LogprobsLists
from replay.errors import UsageError

DEFAULT_TIE_MARGIN = 0.05  # nats: a flip whose top1-top2 margin is below this is a tie flip


class Tolerance(msgspec.Struct, frozen=True):
    """When two logprobs count as equal: |a - b| <= atol + rtol * |b| (both 0: the same bits)."""

    atol: float = 0.0
    rtol: float = 0.0
    tie_margin: float = DEFAULT_TIE_MARGIN

    def __post_init__(self) -> None:
        if not (self.atol >= 0 and self.rtol >= 0 and self.tie_margin >= 0):  # (NaN fails too)
            raise UsageError(f"tolerance atol={self.atol:g}, rtol={self.rtol:g}, tie margin {self.tie_margin:g}: "
                             "expected numbers >= 0")

    @property
    def bitwise(self) -> bool:
        """True when nothing but identical bits is equal."""
        return self.atol == 0 and self.rtol == 0

    def equal(self, a: np.ndarray, b: np.ndarray) -> bool:
        """Arrays equal within the tolerance (NaN equals NaN)."""
        if a.shape != b.shape:
            return False
        if self.bitwise:
            return a.tobytes() == b.tobytes()
        return bool(np.allclose(a, b, rtol=self.rtol, atol=self.atol, equal_nan=True))


class Row(NamedTuple):
    """One output position's logprobs, in vLLM's columns: column 0 the sampled token, columns 1.. the top-k."""

    ids: np.ndarray  # [k + 1] token ids
    values: np.ndarray  # [k + 1] raw logprobs
    rank: int  # rank of the sampled token (1 = the top token)


def row(lp: LogprobsLists | None, i: int) -> Row | None:
    """Row `i` of a LogprobsLists (None when there is none)."""
    if lp is None or i >= lp.num_rows:
        return None
    return Row(lp.logprob_token_ids.to_numpy()[i], lp.logprobs.to_numpy()[i], int(lp.sampled_token_ranks.to_numpy()[i]))


def margin(r: Row | None) -> float | None:
    """top1 - top2 raw logprob of a row (None without at least two top-k columns, or where columns 1 and 2 cannot
    be a top1-top2 pair: both -inf, the padding of a row beside a `logprob_token_ids` request, or a larger second
    column, a `logprob_token_ids` row's ids in the request's order). None sends the diff to the runner's own margin,
    or counts the flip as confident: two paddings are no evidence of a near-tie."""
    if r is None or len(r.values) < 3:
        return None
    top1, top2 = float(r.values[1]), float(r.values[2])  # (Python floats: -inf - -inf would warn in numpy)
    if top1 == top2 == float("-inf") or top1 < top2 or top1 < float(r.values[0]):  # (a top-1 is >= the sampled)
        return None
    return top1 - top2


def below_argmax(r: Row) -> bool:
    """Whether a row's sampled token surely scored below another token (a greedy sampler that missed its argmax).
    vLLM's rank counts the tokens scored at least as high, itself included, so an argmax tied exactly with another
    token (real vocabularies, bfloat16) has rank 2. Any column scored higher says so in either layout (the top-k,
    or the ids a `logprob_token_ids` batch asked, -inf where a row asked none); a top-1 column tied with the sampled
    token says it was the argmax. Where no column tells, rank 2 is a tie or a miss alike (not claimed), and rank 3
    or more would need three tokens tied exactly."""
    if r.rank == 1:
        return False
    others = r.values[1:][np.isfinite(r.values[1:])]
    if others.size and float(others.max()) > float(r.values[0]):
        return True
    if len(r.values) >= 2 and np.isfinite(r.values[1]) and r.values[1] >= r.values[0]:  # column 1 is the top-1
        return False
    return r.rank >= 3


class RowDiff(NamedTuple):
    """How two rows of one output position compare (`compare_rows`)."""

    max_abs: float  # max |Δlogprob| over every logprob both rows hold (NaN pairs and equal infinities count 0)
    equal: bool  # equal under the tolerance (bitwise: the same ids, rank and bits)
    topk_changed: bool  # the top-k ids (set or order) differ
    rank_changed: bool  # the sampled token's rank differs
    held_within: bool  # every logprob both rows hold is within the tolerance (a NaN on one side only is not)

    @property
    def near_tie(self) -> bool:
        """Equal within the tolerance, yet a rank or the top-k order moved: tokens whose logprobs lie within the
        tolerance of each other were ordered another way (a tie in the logits), not a divergence."""
        return self.equal and (self.rank_changed or self.topk_changed)


def _held_pairs(a: Row, b: Row) -> tuple[np.ndarray, np.ndarray]:
    """The logprobs both rows hold, side by side: each token both rows list (the sampled token's column 0 included,
    so two sides that sampled different tokens compare what both computed, not one token's logprob with another's),
    and the k-th best logprob of each side position by position (a token only one side lists among its top k was
    just past the other side's cut-off, which is what its k-th value says)."""
    other: dict[int, float] = {}
    for t, v in zip(b.ids.tolist(), b.values.tolist()):
        other.setdefault(t, v)
    xs, ys, seen = [], [], set()
    for t, v in zip(a.ids.tolist(), a.values.tolist()):
        if t in other and t not in seen:
            seen.add(t)
            xs.append(v)
            ys.append(other[t])
    k = min(len(a.values), len(b.values)) - 1
    if k > 0:
        xs += np.sort(a.values[1:k + 1])[::-1].tolist()
        ys += np.sort(b.values[1:k + 1])[::-1].tolist()
    return np.asarray(xs, np.float64), np.asarray(ys, np.float64)


def compare_rows(a: Row, b: Row, tol: Tolerance) -> RowDiff:
    """One meaning of "equal within tolerance", for every command: the rows are equal when every logprob both
    hold is within `tol` (a rank or top-k order that moved among values within the tolerance is a near-tie).
    Bitwise (`tol.bitwise`), any other id, order, rank or bit is a difference, and is named as such."""
    x, y = _held_pairs(a, b)
    with np.errstate(invalid="ignore"):
        d = np.abs(x - y)
    same = (x == y) | (np.isnan(x) & np.isnan(y))  # equal infinities and NaN on both sides: nothing moved
    d[same] = 0.0
    finite = d[~np.isnan(d)]
    max_abs = float(finite.max()) if finite.size else 0.0
    # vLLM returns as many top-k columns as the batch's largest `logprobs` asks for, so one request's rows are wider
    # in one batch than in another: the columns past the narrower row's are not a change
    n = min(len(a.ids), len(b.ids))
    topk_changed = a.ids[1:n].tobytes() != b.ids[1:n].tobytes()
    rank_changed = a.rank != b.rank
    with np.errstate(invalid="ignore"):
        held_within = bool(np.all(same | (d <= tol.atol + tol.rtol * np.abs(y))))  # NaN on one side: False
    if tol.bitwise:
        equal = (a.ids[:n].tobytes() == b.ids[:n].tobytes() and not rank_changed
                 and a.values[:n].tobytes() == b.values[:n].tobytes())
    else:
        equal = held_within
    return RowDiff(max_abs, equal, topk_changed, rank_changed, held_within)


def same_distribution(d: RowDiff) -> bool:
    """Two rows of a random draw that sampled different tokens come from the same distribution: the top-k ids are
    the same and every logprob both hold is within the tolerance, rtol included (bitwise: equal; a NaN on one side
    only is never within). The sampled column and the sampled token's rank belong to the draw, not to the
    distribution. The tolerance is the one `compare_rows` judged `d` under."""
    return not d.topk_changed and d.held_within


def classify(margin_: float | None, tol: Tolerance, noise: float = 0.0) -> str:
    """tie | confident. A flip is a tie flip when its top1-top2 margin is below `tol.tie_margin`, or within twice
    the logprob noise measured at that very position (`noise` = max |Δlogprob| there): the numerics moved the
    logprobs by as much as it took to swap the top two. An unknown margin counts as confident."""
    if margin_ is None:
        return "confident"
    return "tie" if margin_ < tol.tie_margin or margin_ <= 2 * noise else "confident"
