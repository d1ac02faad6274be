"""The one-sentence verdict of `replay diff A B` (`CaptureDiff.verdict`), and the clause every comparison's verdict
adds for near-ties: the terminal and the HTML report lead with these words."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replay.diff.captures import CaptureDiff


def near_ties(count: int) -> str:
    """'; 3 near-tie rank changes, within tolerance' ('' for none): positions whose rank or top-k order moved
    among logprobs within the tolerance, which the comparison counts and does not call divergences."""
    if not count:
        return ""
    return f"; {count} near-tie rank change{'s' * (count != 1)}, within tolerance"


def capture_diff_verdict(res: CaptureDiff) -> str:
    """The sentence `replay diff A B` leads with."""
    d = res.first_divergence
    tol = res.tolerance
    within = "" if tol.bitwise else f" within atol {tol.atol:g}, rtol {tol.rtol:g}"
    if d is None:
        lost = " (data was lost: the readable prefixes match)" if res.data_lost else ""
        return (f"MATCH: every common request produced the same tokens and logprobs{within}{near_ties(res.near_ties)}"
                f"{lost}")
    where = "token" if d.kind == "routed_experts" else "output position"
    return (f"DIVERGED: {res.requests_diverged} request(s) differ; first: request {d.request_id}, {where} "
            f"{d.position}{near_ties(res.near_ties)}")
