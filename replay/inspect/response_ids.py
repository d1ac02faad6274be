"""An OpenAI server's response id (`cmpl-X`) and its engine's requests, one per prompt (`cmpl-X-0`, `cmpl-X-1`)."""

from __future__ import annotations

from collections.abc import Iterable


def response_prompts(name: str, names: Iterable[str]) -> list[str]:
    """The requests of `names` (external ids) that response `name`'s prompts became, in prompt order."""
    out = [x for x in names if x.startswith(f"{name}-") and x[len(name) + 1:].isdigit()]
    return sorted(out, key=lambda x: int(x[len(name) + 1:]))
