"""Workloads for `replay record`: prompts from a JSONL file, or a synthetic mix drawn from a seed.

JSONL: one object per line with `prompt` (text) or `prompt_token_ids`, an optional `request_id`, an optional
`arrival_step` (the engine step before which it arrives; default 0), and sampling fields under vLLM's
`SamplingParams` names (`structured_outputs` as vLLM's StructuredOutputsParams fields, e.g. {"regex": "[0-9]+"};
vLLM engine only).
"""

from __future__ import annotations

import json
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from replay.contracts import SamplingParams
from replay.errors import UsageError

SAMPLING_FIELDS = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "prompt_logprobs",
                   "logprob_token_ids", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words",
                   "structured_outputs")
_KEYS = frozenset(SAMPLING_FIELDS) | {"prompt", "prompt_token_ids", "request_id", "arrival_step"}


@dataclass(slots=True)
class WorkloadRequest:
    """One request of a workload, before tokenisation."""

    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    request_id: str | None = None
    arrival_step: int = 0


@dataclass(slots=True)
class SyntheticWorkload:
    """A synthetic mix: lengths uniform in the ranges, Poisson arrivals, a share of shared prefixes."""

    num_requests: int = 16
    prompt_len: tuple[int, int] = (8, 48)
    output_len: tuple[int, int] = (8, 32)
    arrival_rate: float = 2.0  # mean arrivals per engine step; 0 = everything at step 0
    shared_prefix_fraction: float = 0.25  # requests that reuse the first request's prompt prefix (prefix caching)
    sampling: str = "mixed"  # greedy | mixed (greedy, seeded and unseeded temperature sampling)
    num_logprobs: int | None = 5
    seed: int = 0
    defaults: dict = field(default_factory=dict)  # sampling fields applied to every request (override the mix)


def _token_key(key: str, where: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise UsageError(f"{where}: logit_bias key {key!r} is not a token id") from None


def _params(fields: dict, where: str) -> SamplingParams:
    try:
        if "logit_bias" in fields and isinstance(fields["logit_bias"], dict):  # JSON keys are strings: token ids
            fields = {**fields, "logit_bias": {_token_key(k, where): v for k, v in fields["logit_bias"].items()}}
        return msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as e:
        raise UsageError(f"{where}: invalid sampling field: {e}") from None


def load_jsonl(path: str | Path, defaults: dict | None = None) -> list[WorkloadRequest]:
    """Parse a prompts file; every problem is a UsageError naming the line."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise UsageError(f"{p}: cannot read prompts: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{p}: prompts file is not UTF-8 text") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: expected a JSON object")
        unknown = set(obj) - _KEYS
        if unknown:
            raise UsageError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; sampling fields use vLLM's "
                             f"SamplingParams names ({', '.join(SAMPLING_FIELDS)})")
        if ("prompt" in obj) == ("prompt_token_ids" in obj):
            raise UsageError(f"{where}: give exactly one of `prompt` (text) or `prompt_token_ids`")
        ids = obj.get("prompt_token_ids")
        if ids is not None and (not isinstance(ids, list) or not ids
                                or not all(isinstance(t, int) and t >= 0 for t in ids)):
            raise UsageError(f"{where}: prompt_token_ids must be a non-empty list of non-negative integers")
        if "prompt" in obj and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
            raise UsageError(f"{where}: prompt must be a non-empty string")
        arrival = obj.get("arrival_step", 0)
        if not isinstance(arrival, int) or arrival < 0:
            raise UsageError(f"{where}: arrival_step must be a non-negative integer")
        rid = obj.get("request_id")
        fields = {**(defaults or {}), **{k: obj[k] for k in SAMPLING_FIELDS if k in obj}}
        out.append(WorkloadRequest(_params(fields, where), obj.get("prompt"), ids, None if rid is None else str(rid),
                                   arrival))
    if not out:
        raise UsageError(f"{p}: no prompts")
    unique_ids(out, str(p))
    return out


def unique_ids(requests: list[WorkloadRequest], where: str = "the workload") -> None:
    """Refuse two requests under one `request_id`: every verdict names requests by it, so a bisect would take two for
    one ("x's numerics change when x shares its batch")."""
    counts = Counter(r.request_id for r in requests if r.request_id is not None)
    twice = sorted(i for i, n in counts.items() if n > 1)
    if twice:
        raise UsageError(f"{where}: request_id values must be unique ({', '.join(twice[:5])} given more than once)")


def synthetic(w: SyntheticWorkload, vocab_size: int, first_token: int = 3) -> list[WorkloadRequest]:
    """Draw a synthetic workload (token ids in [first_token, vocab_size)) from `w.seed`."""
    if w.num_requests < 1:
        raise UsageError("--num-requests must be at least 1")
    for name, (lo, hi) in (("prompt", w.prompt_len), ("output", w.output_len)):
        if not 1 <= lo <= hi:
            raise UsageError(f"--{name}-len {lo}:{hi}: expected 1 <= MIN <= MAX")
    rng = random.Random(w.seed)
    base = [rng.randrange(first_token, vocab_size) for _ in range(w.prompt_len[1])]
    out, step, t = [], 0, 0.0
    for i in range(w.num_requests):
        plen = rng.randint(*w.prompt_len)
        if i and rng.random() < w.shared_prefix_fraction:
            keep = rng.randint(plen // 2, plen)
            prompt = base[:keep] + [rng.randrange(first_token, vocab_size) for _ in range(plen - keep)]
        else:
            prompt = [rng.randrange(first_token, vocab_size) for _ in range(plen)]
        fields: dict = {"max_tokens": rng.randint(*w.output_len), "ignore_eos": True}
        if w.num_logprobs is not None:
            fields["logprobs"] = w.num_logprobs
        kind = rng.random() if w.sampling == "mixed" else 0.0
        if kind >= 0.5:
            fields.update(temperature=0.8, top_p=0.95)
            if kind < 0.75:
                fields["seed"] = rng.randrange(1 << 31)
        else:
            fields["temperature"] = 0.0
        fields.update(w.defaults)
        if w.arrival_rate > 0:
            t += rng.expovariate(w.arrival_rate)
            step = int(t)
        out.append(WorkloadRequest(_params(fields, "synthetic workload"), None, prompt, f"req-{i}", step))
    return out


class Arrivals:
    """A workload's requests in arrival order, handed out as the engine reaches their arrival steps; both
    recorders drive their engines with it."""

    def __init__(self, requests: list[WorkloadRequest]) -> None:
        order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_step, i))
        self._pending = deque((i, requests[i]) for i in order)
        # what a progress bar counts up to: vLLM's default max_tokens (16) where a request does not say
        self.expected_tokens = sum(r.params.max_tokens or 16 for r in requests)

    def __bool__(self) -> bool:
        return bool(self._pending)

    def due(self, step: int, idle: bool) -> list[tuple[int, WorkloadRequest]]:
        """(index in the workload, request) of every request arriving by `step`. An idle engine jumps to the next
        arrival instead of spinning on empty steps."""
        if idle and self._pending:
            step = max(step, self._pending[0][1].arrival_step)
        out = []
        while self._pending and self._pending[0][1].arrival_step <= step:
            out.append(self._pending.popleft())
        return out


def workload_requests(model: str, prompts: str | Path | None, workload: SyntheticWorkload) -> list[WorkloadRequest]:
    """What `replay record` runs: the prompts file's requests (with `workload.defaults` as sampling defaults) or,
    without one, the synthetic mix `workload` describes, drawn over `model`'s vocabulary."""
    if prompts is not None:
        return load_jsonl(prompts, workload.defaults)
    from replay.engine.weights import load_model_config_for

    return synthetic(workload, load_model_config_for(model).vocab_size)
