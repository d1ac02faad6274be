"""`Twins`: requests of one recording with the same prompt and sampling whose outputs differ (`replay explain
--pairs` finds them; the HTML report lists them)."""

from __future__ import annotations

import msgspec


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
