"""The keyframe record (format 1.6; docs/design.md, "The flight recorder"): the state a runner needs to start at step K,
and nothing else.

A `SchedulerOutput` is a diff against the runner's cached per-request state, so a replay has to start where that
state is known. Step 0 is one such place (nothing cached). A keyframe makes step K another: it lists every request
live before step K (its arrival, its tokens so far, how many of them its KV blocks hold, its block table, the draws
its generator has made) and, where prefix caching can hand a later request blocks that no live request holds, what
those blocks were filled with. A runner primes itself from it by prefilling those tokens into those blocks
(`replay.replayer.prime`), then applies step K's diff as usual.

The writer builds keyframes from its own shadow of the request table (`replay.capture.format.shadow`), folded from
the records it already writes: the engine thread pays nothing for them.
"""

from __future__ import annotations

import msgspec

from replay.contracts import EngineCoreRequest


class LiveRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request live before the keyframe's step: arrived, not finished."""

    request: EngineCoreRequest  # its arrival, as recorded (prompt ids, sampling params, LoRA, external id)
    arrived: int  # the step its arrival record names
    scheduled: bool = False  # whether the runner has seen it (False: waiting for its first schedule)
    output_token_ids: list[int] = []  # [num_output_tokens]: every token it sampled so far
    # tokens whose K/V its blocks hold, counted from position 0 (its last step's num_computed_tokens plus what that
    # step computed and kept); 0 for a request preempted since (its blocks went to others: it recomputes on resume)
    num_computed_tokens: int = 0
    block_ids: list[list[int]] = []  # [num_kv_cache_groups][num_blocks]: its block table
    num_draws: int = 0  # steps in which it sampled: a random request's generator has drawn this many times
    drawn_seed: int | None = None  # the seed the engine drew for it (an unseeded random request, Step.drawn_seeds)
    preempted: bool = False  # its blocks went to other requests since its last step: no K/V to rebuild

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output tokens: what the runner knows of it."""
        return list(self.request.prompt_token_ids or ()) + self.output_token_ids


class CachedBlocks(msgspec.Struct, array_like=True, omit_defaults=True):
    """Blocks a finished or preempted request filled and no live request holds, still there for a prefix-cache hit
    of a later request: block j of `block_ids` holds the K/V of `token_ids[j * block_size:(j + 1) * block_size]`,
    computed over all the tokens before it."""

    token_ids: list[int]  # [num_tokens]: from position 0, whole blocks only
    block_ids: list[list[int]]  # [num_kv_cache_groups][num_tokens / block_size]
    last_step: int  # the last step that wrote into them (a keyframe lists them oldest first)


class Keyframe(msgspec.Struct, tag="keyframe", array_like=True, omit_defaults=True):
    """Format 1.6: the runner state before step `step`. First record of its chunk; the chunk's `LiveIds` resolve its
    steps, so reading can start here."""

    step: int  # the state before this step (every record before the keyframe is folded in)
    requests: list[LiveRequest]  # in arrival order
    # prefix-cache content no live request holds, oldest writer first: priming in this order, then the live
    # requests, leaves every block with its latest content (a block a later writer took is rewritten by it)
    cached: list[CachedBlocks] = []
    block_size: int = 0  # tokens per KV block, as the shadow counted them (the header's engine_config)
    # the runner's persistent batch after the last step, in row order (that step's ModelRunnerOutput.req_ids): a
    # runner that restores it lays step K's rows out as the recording did, which decides the bits of batched kernels
    batch: list[str] = []

    def live(self, req_id: str) -> LiveRequest | None:
        """The live request with internal id `req_id`, if any."""
        for r in self.requests:
            if r.request.request_id == req_id:
                return r
        return None
