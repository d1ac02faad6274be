"""Twins: requests of one recording with the same prompt and sampling, which should give the same answer, and where
those that did not part (`replay explain --pairs` finds them, `explain --pair` explains two; the HTML report lists
them). What decides each sampled token must match (temperature, top-p/k, min-p, penalties, biases, grammar, a random
request's seed); when each stops and what it returns beside its tokens may differ, and such twins are compared over
their common tokens."""

from __future__ import annotations

import os
from collections import defaultdict

import msgspec
import numpy as np

from replay.capture import CaptureReader, RequestAdded, Step
from replay.contracts import SAMPLING_EPS, RequestOutputKind
from replay.diff.captures import AlignedRun, read_aligned


class Twins(msgspec.Struct):
    """Requests with the same prompt and sampling whose outputs differ."""

    requests: list[str]  # external ids, in arrival order
    position: int  # the first output position where any two part
    kind: str  # "token" | "logprobs" | "length" | "prompt_logprobs" (then `position` is the prompt's)
    max_abs_logprob_diff: float  # at that position, over the logprobs both hold
    pair: list[str] = []  # the two that part there (the first such, in arrival order): the pair `--pairs` explains
    answers: int = 0  # distinct answers among them (token sequences; 0 where only logprobs or prompts part)

    def describe(self) -> str:
        """'a, b, c: 2 distinct answers; a and c part at output position 3 (token)': the group in one line."""
        size = f", max |Δlogprob| {self.max_abs_logprob_diff:.3g}" if self.kind == "logprobs" else ""
        many = len(self.requests) > 2
        answers = f"{self.answers} distinct answers; " if self.answers > 2 or (self.answers and many) else ""
        first = f"{' and '.join(self.pair)} " if self.pair and many else ""
        return (f"{', '.join(self.requests)}: {answers}{first}part at output position {self.position} "
                f"({self.kind}{size})")


def arrivals(path: str | os.PathLike) -> dict[str, RequestAdded]:
    """External id -> arrival."""
    with CaptureReader(path) as r:
        return {rec.request.name: rec for rec in r.records() if isinstance(rec, RequestAdded)}


# What stops a request, or what it returns beside its tokens: two requests that differ only here still sample the same
# tokens until the first of them stops (the stop token ids, unless `min_tokens` masks them, and the seed of a greedy
# request, too), so they are twins over their common length
_NOT_SAMPLING = dict(n=1, max_tokens=None, stop=None, ignore_eos=False, logprobs=None, prompt_logprobs=None,
                     logprob_token_ids=None, flat_logprobs=False, detokenize=True, skip_special_tokens=True,
                     spaces_between_special_tokens=True, include_stop_str_in_output=False,
                     output_kind=RequestOutputKind.CUMULATIVE, extra_args=None)
_STOPS = ("max_tokens", "stop", "stop_token_ids", "all_stop_token_ids", "eos_token_id", "ignore_eos",
          "include_stop_str_in_output", "min_tokens")


def twin_key(rec: RequestAdded) -> tuple | None:
    """What two requests must share to be twins: the prompt and what decides each sampled token (not when they stop,
    nor what they return beside it); None for a request whose draws differ by design (unseeded)."""
    req = rec.request
    sp = req.sampling_params
    if sp is None or req.prompt_token_ids is None:
        return None
    if sp.temperature >= SAMPLING_EPS and sp.seed is None:
        return None
    same = dict(_NOT_SAMPLING)
    if not sp.min_tokens:  # (below min_tokens the stop tokens are masked out of the logits)
        same.update(stop_token_ids=None, all_stop_token_ids=None, eos_token_id=None)
    if sp.temperature < SAMPLING_EPS:  # greedy, however it was said: no draw, so no seed either
        same.update(seed=None, temperature=0.0)
    return tuple(req.prompt_token_ids), msgspec.json.encode(msgspec.structs.replace(sp, **same))


def _stops_alike(a: RequestAdded, b: RequestAdded) -> bool:
    """Whether two twins would stop at the same token: else a length apart is no parting."""
    sa, sb = a.request.sampling_params, b.request.sampling_params
    return all(getattr(sa, f) == getattr(sb, f) for f in _STOPS)


def part(a: list, b: list, cut: tuple[bool, bool] = (False, False)) -> tuple[int, str, float] | None:
    """The first position where two (step, token, row) lists part: (position, kind, max |Δlogprob| there). `cut`:
    whether each list stops where its capture lost data (then a shorter one is no parting)."""
    for p, ((_, ta, ra), (_, tb, rb)) in enumerate(zip(a, b)):
        if ta != tb:
            return p, "token", 0.0
        n = min(len(ra.ids), len(rb.ids)) if ra is not None and rb is not None else 0
        # (a row is as wide as its batch's largest `logprobs`: the columns past the narrower row's are no parting)
        if ra is not None and rb is not None and not (np.array_equal(ra.ids[:n], rb.ids[:n]) and
                                                      np.array_equal(ra.values[:n], rb.values[:n])):
            common = ra.ids[np.isin(ra.ids, rb.ids)]
            va = {int(i): float(v) for i, v in zip(ra.ids, ra.values)}
            vb = {int(i): float(v) for i, v in zip(rb.ids, rb.values)}
            return p, "logprobs", max((abs(va[int(i)] - vb[int(i)]) for i in common), default=float("inf"))
    if len(a) != len(b) and not cut[len(a) > len(b)]:
        return min(len(a), len(b)), "length", 0.0
    return None


def parting(side: AlignedRun, a: RequestAdded, b: RequestAdded) -> tuple[list, list, tuple[int, str, float] | None]:
    """Two twins' recorded outputs, (step, token, row) lists, and where they part (`part`): a list stops short of
    the other with no parting where its capture lost data, or where it was asked to stop otherwise."""
    keys = [side.key_of.get(x.request.request_id, "") for x in (a, b)]
    seq_a, seq_b = (side.outputs.get(k, []) for k in keys)
    apart = not _stops_alike(a, b)
    return seq_a, seq_b, part(seq_a, seq_b, (keys[0] in side.cut or apart, keys[1] in side.cut or apart))


def prompt_rows(path: str | os.PathLike, rids: set[str]) -> dict[str, np.ndarray]:
    """Internal id -> its prompt logprobs as recorded ([prompt_len - 1, k + 1] values, the chunks in order), for
    those of `rids` that asked for them."""
    parts: dict[str, list[np.ndarray]] = defaultdict(list)
    with CaptureReader(path) as r:
        for rec in r.records():
            if isinstance(rec, Step) and rec.model_runner_output is not None:
                for rid, t in rec.model_runner_output.prompt_logprobs_dict.items():
                    if rid in rids and t is not None:
                        parts[rid].append(np.stack([t.logprob_token_ids.to_numpy().astype(np.float64),
                                                    t.logprobs.to_numpy().astype(np.float64)]))
    return {rid: np.concatenate(p, axis=1) for rid, p in parts.items()}


def prompt_part(a: np.ndarray | None, b: np.ndarray | None) -> tuple[int, str, float] | None:
    """The first prompt position whose logprobs (ids and values) two requests' prompt rows part at."""
    if a is None or b is None or a.shape[:2] != b.shape[:2]:
        return None
    n = min(a.shape[2], b.shape[2])  # as wide as the batch's largest `prompt_logprobs`: the columns both hold
    a, b = a[:, :, :n], b[:, :, :n]
    apart = np.flatnonzero((a != b).any(axis=(0, 2)))
    if not len(apart):
        return None
    k = int(apart[0])
    same_ids = np.array_equal(a[0, k], b[0, k])
    return k + 1, "prompt_logprobs", float(np.abs(a[1, k] - b[1, k]).max()) if same_ids else float("inf")


def twin_groups(path: str | os.PathLike) -> list[Twins]:
    """Every group of requests with the same prompt and sampling (greedy, or the same seed) whose outputs differ,
    those that part in a token first, then by the size of their first difference."""
    return twins_compared(path)[1]


def twins_compared(path: str | os.PathLike) -> tuple[int, list[Twins]]:
    """(How many groups of requests share a prompt and sampling, `twin_groups`): none compared and none differing
    are two answers."""
    arrived = arrivals(path)
    side = read_aligned(path)
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name, rec in arrived.items():
        key = twin_key(rec)
        if key is not None:
            groups[key].append(name)
    twins = [names for names in groups.values() if len(names) > 1]
    prompts = prompt_rows(path, {arrived[n].request.request_id for names in twins for n in names})
    out = []
    for names in twins:
        ids = [arrived[n].request.request_id for n in names]
        seqs = [side.outputs.get(side.key_of.get(rid, ""), []) for rid in ids]
        pairs = [(i, j) for i in range(len(names)) for j in range(i + 1, len(names))]  # (groups are small)
        recs = [arrived[n] for n in names]
        parts = [(x, i, j) for i, j in pairs if (x := parting(side, recs[i], recs[j])[2]) is not None]
        parts = parts or [(x, i, j) for i, j in pairs
                          if (x := prompt_part(prompts.get(ids[i]), prompts.get(ids[j]))) is not None]
        if parts:
            (p, kind, diff), i, j = min(parts, key=lambda x: x[0][0])  # (the first pair that parts there)
            shortest = min(map(len, seqs))  # (twins that stop apart by design: their answers over the common length)
            answers = len({tuple(t for _, t, _ in seq[:shortest]) for seq in seqs})
            out.append(Twins(names, p, kind, diff, [names[i], names[j]], answers if answers > 1 else 0))
    return len(twins), sorted(out, key=lambda t: (t.kind != "token",
                                                  -t.max_abs_logprob_diff if t.kind != "token" else 0))
