"""A request's prompt, encoded once: at its arrival, and reused by the step that first schedules it.

A prompt is stored twice, by design: in its `RequestAdded` record (replay needs every arrival, scheduled or not) and
in the `NewRequestData` of the step that first schedules it (a step reads on its own, from its own chunk). Both
encode the same list: on the prefill-heavy workload (prompts of 1-4k tokens) that was ~35 us an arrival, a tenth of
capture_bench's whole write. Here the second encode is the first one's bytes (`msgspec.Raw`, which msgspec writes as
they are), when the step's list holds the very objects the arrival's did (`_wire.same_items`, a memcmp of item
pointers): ints are immutable, so the bytes are what msgspec would write. Lossless by construction; anything else
(a list rebuilt, mutated, or holding a non-int) is encoded as ever.
"""

from __future__ import annotations

from typing import Any

from msgspec import Raw
from msgspec.structs import replace

from replay.capture.codec.fastwire import COMPILED
from replay.contracts import EngineCoreRequest

# Prompts held at most, in tokens (a copy of the item pointers and the encoded bytes: ~12 B a token, so ~12 MB). A
# server's queue can hold more than that unscheduled; those arrivals are encoded twice, as before.
MAX_HELD_TOKENS = 1 << 20


class ArrivedPrompts:
    """The encoded prompts of the arrivals no step has scheduled yet, by request id."""

    def __init__(self, max_tokens: int = MAX_HELD_TOKENS):
        self._held: dict[str, tuple[tuple, Raw]] = {}
        self._tokens = 0
        self._max = max_tokens if COMPILED is not None else 0  # (the Python passes have no cheap identity check)

    def arrived(self, request: EngineCoreRequest) -> EngineCoreRequest:
        """`request` to encode: its prompt as bytes, kept for the step that schedules it (else `request` itself)."""
        prompt = request.prompt_token_ids
        if type(prompt) is not list or not prompt or self._tokens + len(prompt) > self._max:
            return request
        try:  # the objects encoded are held, so that none is freed and its address reused
            data, items = COMPILED.ints_held(prompt)
        except (TypeError, OverflowError):  # not all exact ints in 64 bits: msgspec encodes it
            return request
        data = Raw(data)
        self.forget(request.request_id)
        self._held[request.request_id] = (items, data)
        self._tokens += len(items)
        return replace(request, prompt_token_ids=data)

    def scheduled(self, req_id: str, prompt: Any) -> Any:
        """The prompt of a newly scheduled request as stored: its arrival's bytes if it holds the same objects."""
        held = self._held.pop(req_id, None)
        if held is None:
            return prompt
        self._tokens -= len(held[0])
        if type(prompt) is list and COMPILED.same_items(prompt, held[0]):
            return held[1]
        return prompt

    def forget(self, req_id: str) -> None:
        """Drop what is held for `req_id` (an abort, or a request id used again)."""
        held = self._held.pop(req_id, None)
        if held is not None:
            self._tokens -= len(held[0])

    def clear(self) -> None:
        """Drop everything held."""
        self._held.clear()
        self._tokens = 0

    def stop(self) -> None:
        """Drop everything held and hold nothing more: the steps come as images (another engine's objects, stored as
        they are), which never reuse an arrival's bytes."""
        self.clear()
        self._max = 0

    @property
    def held_tokens(self) -> int:
        """How many prompt tokens are held."""
        return self._tokens
