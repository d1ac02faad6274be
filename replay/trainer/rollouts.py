"""The rollouts of a capture as a trainer receives them: each request's prompt and generated tokens, with the value
vLLM returned for each sampled token (column 0 of its logprobs row), the step that sampled it and that step's batch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from replay.capture import CaptureReader, Header, RequestAdded
from replay.contracts import SamplingParams
from replay.diff.captures import read_aligned


@dataclass(slots=True)
class Rollout:
    """One sequence: what a trainer would score."""

    name: str  # the request's external id
    prompt: list[int]
    tokens: list[int]  # generated, in order
    values: list[float | None]  # what vLLM returned for each (None: the request asked for no logprobs)
    steps: list[int]  # the step that sampled each token
    params: SamplingParams
    # token index (prompt first) -> the experts vLLM routed it to, [MoE layers, top-k], where the capture kept routing
    routing: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass(slots=True)
class Rollouts:
    """Every rollout of a capture, with its header and each step's batch (requests, tokens)."""

    header: Header
    rollouts: list[Rollout] = field(default_factory=list)
    batches: dict[int, tuple[int, int]] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)  # every request's name, picked or not
    lost: list[str] = field(default_factory=list)  # where the capture lost data: sequences end there

    def none_generated(self, path: str | os.PathLike, names: list[str]) -> str:
        """The refusal for `names` that generated no token, naming the sequences of an n > 1 request named by its
        parent's id."""
        children = [n for n in self.names if any(n.startswith(f"{x}#") for x in names)]
        hint = f" (its sequences: {', '.join(children)})" if children else ""
        return f"{path}: no request {', '.join(names)} generated a token{hint}"


def read_rollouts(path: str | os.PathLike, names: list[str] | None = None) -> Rollouts:
    """The capture's requests that generated at least one token (or those `names` pick), in arrival order."""
    side = read_aligned(path)
    with CaptureReader(path) as r:
        arrivals = [rec for rec in r.records() if isinstance(rec, RequestAdded)]
    out = Rollouts(side.header, batches={s: (b.num_requests, b.num_tokens) for s, b in side.batches.items()},
                   lost=list(side.lost))
    for rec in arrivals:
        req = rec.request
        out.names.append(req.name)
        if names is not None and req.name not in names and req.request_id not in names:
            continue
        key = side.key_of.get(req.request_id, "")
        seq = side.outputs.get(key, [])
        tokens, values, steps = [], [], []
        for step, token, row in seq:
            if token < 0:  # a placeholder (a rejected draft's slot): the sequence ends before it
                break
            tokens.append(int(token))
            values.append(None if row is None else float(row.values[0]))
            steps.append(step)
        if tokens:
            out.rollouts.append(Rollout(req.name, list(req.prompt_token_ids or ()), tokens, values, steps,
                                        req.sampling_params or SamplingParams(),
                                        {t: rows for t, (_, rows) in side.routing.get(key, {}).items()}))
    return out
