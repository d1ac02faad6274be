"""Other content of the same shapes: `Swap` rewrites the token ids of chosen requests in every step a replay runs,
and nothing else, so the batch keeps every shape it had (prompt and output lengths, computed tokens, chunking,
block tables, row positions) while those requests carry other tokens.

In a correct dense engine a request cannot depend on a neighbour's *content* once every shape is fixed, so a
request whose rows move when its neighbours' tokens are swapped reads something of theirs: contamination
(`replay.bisect.leak`). Leaving neighbours out (`bisect batch`) changes shapes too, and cannot tell the two apart.

A swapped request's positions are rewritten from the first it computes itself: the tokens it found in the prefix
cache (`num_computed_tokens` at its first schedule) are K/V another request wrote, and keep their ids. Its sampled
tokens, which forced mode feeds back, are rewritten at their positions too, and so are the drafts it verifies. A
request whose K/V the watched request reads through the prefix cache (`kept`) keeps the ids of those leading tokens
as well, and is given other content after them: what the watched request reads of it stays what was recorded.
"""

from __future__ import annotations

import zlib

import msgspec
import numpy as np

from replay.contracts import NewRequestData, SchedulerOutput
from replay.errors import UsageError

CONTENTS = ("random", "shuffled", "repeated")  # random ids; its own prompt ids in another order; one id throughout


class _Content:
    """One request's other content: the id at each position."""

    def __init__(self, kind: str, rid: str, prompt: list[int], hit: int, vocab_size: int, seed: int) -> None:
        self.kind, self.prompt, self.hit, self.vocab_size = kind, prompt, hit, vocab_size
        self.rng = np.random.default_rng([seed, zlib.crc32(rid.encode())])
        self.drawn: list[int] = []
        self.one = int(self.rng.integers(vocab_size))
        own = prompt[hit:] or prompt or [self.one]
        self.shuffled = [int(x) for x in self.rng.permutation(own)]

    def at(self, position: int, original: int) -> int:
        """The id at `position` (`original`: the recorded one, kept inside the prefix-cache hit)."""
        if position < self.hit:
            return original
        if self.kind == "repeated":
            return self.one
        if self.kind == "shuffled":
            return self.shuffled[(position - self.hit) % len(self.shuffled)]
        while len(self.drawn) <= position:
            self.drawn.extend(int(x) for x in self.rng.integers(self.vocab_size, size=256))
        return self.drawn[position]


class Swap:
    """Rewrites the token ids of the requests in `kinds` (internal id -> one of `CONTENTS`) in the steps of a replay:
    `step` before a step runs, `sampled` on the tokens forced mode feeds back after it."""

    def __init__(self, kinds: dict[str, str], vocab_size: int, seed: int = 0,
                 kept: dict[str, int] | None = None) -> None:
        bad = sorted({k for k in kinds.values() if k not in CONTENTS})
        if bad:
            raise UsageError(f"content {bad[0]!r}: expected one of {', '.join(CONTENTS)}")
        if vocab_size <= 1:
            raise UsageError("swapping content needs the model's vocabulary size")
        self.kinds, self.vocab_size, self.seed = dict(kinds), vocab_size, seed
        self.kept = dict(kept or {})  # internal id -> leading tokens that keep their ids (K/V another request reads)
        self.contents: dict[str, _Content] = {}
        self.outputs: dict[str, int] = {}  # output tokens each swapped request has so far

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def unseen(self) -> list[str]:
        """Swapped requests whose first schedule the replay has not seen (live where it started)."""
        return [r for r in self.kinds if r not in self.contents]

    def _new(self, n: NewRequestData) -> NewRequestData:
        if n.prompt_token_ids is None or n.prompt_embeds is not None or n.mm_features:
            raise UsageError(f"request {n.req_id!r} has prompt embeddings or multimodal inputs: its content cannot be "
                             "swapped with the same shapes")
        prompt = list(n.prompt_token_ids)
        keep = max(n.num_computed_tokens, self.kept.get(n.req_id, 0))
        c = self.contents[n.req_id] = _Content(self.kinds[n.req_id], n.req_id, prompt, keep, self.vocab_size,
                                               self.seed)
        self.outputs[n.req_id] = 0
        return msgspec.structs.replace(n, prompt_token_ids=[c.at(p, t) for p, t in enumerate(prompt)])

    def _tokens(self, rid: str, first: int, toks: list[int]) -> list[int]:
        c = self.contents[rid]
        return [c.at(first + i, t) for i, t in enumerate(toks)]

    def _output_start(self, rid: str) -> int:
        return len(self.contents[rid].prompt) + self.outputs[rid]

    def step(self, so: SchedulerOutput) -> SchedulerOutput:
        """The step with the swapped requests' ids rewritten: new prompts, resumed requests' tokens, the tokens
        pipeline parallelism hands over, and drafts."""
        if not any(r in self.kinds for r in so.num_scheduled_tokens):
            return so
        new = [self._new(n) if n.req_id in self.kinds else n for n in so.scheduled_new_reqs]
        cr = so.scheduled_cached_reqs
        all_tokens = {r: self._tokens(r, 0, t) if r in self.contents else t for r, t in cr.all_token_ids.items()}
        handed = [self._tokens(r, self._output_start(r) - len(t), t) if r in self.contents else t
                  for r, t in zip(cr.req_ids, cr.new_token_ids)] if cr.new_token_ids else []
        drafts = {r: self._tokens(r, self._output_start(r), t) if r in self.contents else t
                  for r, t in so.scheduled_spec_decode_tokens.items()}
        cached = msgspec.structs.replace(cr, all_token_ids=all_tokens, new_token_ids=handed)
        return msgspec.structs.replace(so, scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                                       scheduled_spec_decode_tokens=drafts)

    def sampled(self, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """The recorded tokens of a step, as forced mode feeds them back, the swapped requests' rewritten at their
        positions (and counted)."""
        out = {}
        for rid, toks in sampled.items():
            if rid in self.contents:
                out[rid] = self._tokens(rid, self._output_start(rid), toks)
                self.outputs[rid] += len(toks)
            else:
                out[rid] = toks
        return out
