"""`position_mismatches`: two recorded runs (`replay report A B`), compared at every output position the heat map
needs, where `replay diff` stops at each request's first difference.

Requests are aligned exactly as `replay diff` aligns them (`replay.diff.captures`' reader: external id, else prompt
and arrival order) and each position is judged by the diff's own rules (`replay.diff.rules`). A request is
compared up to its first token flip: after it, A and B continue from different tokens and their numbers are no
longer about the same context, so those positions are "not compared", not divergences.
"""

from __future__ import annotations

import os

from replay.diff import Divergence, Tolerance, classify
from replay.diff.captures import read_aligned
from replay.diff.rules import compare_rows, margin, same_distribution


def position_mismatches(a_path: str | os.PathLike, b_path: str | os.PathLike,
                        tol: Tolerance) -> tuple[list[Divergence], dict[str, int]]:
    """Every position of every request both captures hold where they differ (steps and internal ids are A's), in
    A's step order; and, per request that flipped a token, A's step of the flip (later positions not compared)."""
    a, b = read_aligned(a_path), read_aligned(b_path)  # the alignment `replay diff` uses, not a copy of it
    rid_of = {key: rid for rid, key in a.key_of.items()}
    out: list[Divergence] = []
    flipped: dict[str, int] = {}
    for key in a.order:
        if key not in b.prompts or key not in rid_of:
            continue
        rid, name = rid_of[key], key.partition(":")[2]
        oa, ob = a.outputs.get(key, []), b.outputs.get(key, [])
        for pos, (sa, ta, ra) in enumerate(oa):
            if pos >= len(ob):  # B stopped earlier: the rest of A has no counterpart
                if key in b.cut:  # (B lost the rest with its capture's damage)
                    break
                out.append(Divergence(sa, name, pos, "length", ta, None, internal_id=rid))
                flipped[rid] = sa
                break
            _, tb, rb = ob[pos]
            lp_diff, equal, alike = 0.0, (ra is None) == (rb is None), False
            if ra is not None and rb is not None:
                cmp = compare_rows(ra, rb, tol)
                lp_diff, equal, alike = cmp.max_abs, cmp.equal, same_distribution(cmp)
            m = margin(ra)
            if ta != tb:
                draw = key in a.random  # a random draw: its margin says nothing
                out.append(Divergence(sa, name, pos, "token", ta, tb, ra.rank if ra else None,
                                      rb.rank if rb else None, lp_diff, None, m,
                                      "draw" if draw else classify(m, tol, lp_diff), internal_id=rid,
                                      same_distribution=draw and alike))
                flipped[rid] = sa
                break
            if not equal:
                out.append(Divergence(sa, name, pos, "logprobs", ta, tb, ra.rank if ra else None,
                                      rb.rank if rb else None, lp_diff, None, m, internal_id=rid))
        else:
            if len(ob) > len(oa) and oa and key not in a.cut:  # A stopped earlier: mark it at A's last step
                out.append(Divergence(oa[-1][0], name, len(oa), "length", None, ob[len(oa)][1], internal_id=rid))
    out.sort(key=lambda d: (d.step, d.kind != "token"))
    return out, flipped
