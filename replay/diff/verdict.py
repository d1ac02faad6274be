"""The clause every comparison's verdict adds for near-ties (`replay run --diff`'s and `replay diff`'s): the terminal
and the HTML report lead with these words."""

from __future__ import annotations


def near_ties(count: int) -> str:
    """'; 3 near-tie rank changes, within tolerance' ('' for none): positions whose rank or top-k order moved
    among logprobs within the tolerance, which the comparison counts and does not call divergences."""
    if not count:
        return ""
    return f"; {count} near-tie rank change{'s' * (count != 1)}, within tolerance"
