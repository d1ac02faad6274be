"""Paged KV blocks with prefix caching: vLLM v1's `BlockPool` + `KVCacheManager` for one full-attention group.

The scheduler owns the blocks; the runner only ever sees block ids. A block holds `block_size` consecutive token
positions of one request. Once a block is full of *known* tokens (prompt, or already-sampled output) it is hashed
by a chain hash over the token ids before it, so another request whose tokens start the same way can reuse its K/V
instead of recomputing them. Freed blocks keep their hash and sit in an LRU free queue: they stay reusable as a
cache hit until a new allocation takes them over (evicts them).

Unlike vLLM we reserve no null block: with one full-attention group nothing ever points at it, so every id in
`0 .. num_gpu_blocks - 1` is usable.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from replay.engine.config import SchedulerConfig
from replay.engine.request import Request

BlockHash = bytes  # sha256 digest, 32 bytes


def hash_block_tokens(parent_block_hash: BlockHash | None, block_token_ids: Sequence[int],
                      extra_keys: tuple[str, ...] | None = None) -> BlockHash:
    """Hash of one full block, chained to the hash of the block before it (vLLM's `hash_block_tokens`).

    sha256 over a msgpack encoding: the same tokens give the same hash in every process and on every machine
    (Python's `hash()` of a str is salted per process). vLLM seeds the first parent with a random `NONE_HASH`;
    we use None, so hashes are reproducible run to run.
    """
    payload = msgspec.msgpack.encode((parent_block_hash, list(block_token_ids), extra_keys))
    return hashlib.sha256(payload).digest()


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of its known tokens; returns the list."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    while (len(hashes) + 1) * block_size <= len(tokens):
        start = len(hashes) * block_size
        parent = hashes[-1] if hashes else None
        # vLLM puts the cache salt into the first block's extra keys only; the chain carries it onwards.
        extra = (request.cache_salt,) if start == 0 and request.cache_salt else None
        hashes.append(hash_block_tokens(parent, tokens[start:start + block_size], extra))
    return hashes


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of the pool. Identity matters (eq=False): two blocks with equal fields are still two blocks."""

    block_id: int
    ref_cnt: int = 0  # requests currently holding it; 0 = in the free queue
    block_hash: BlockHash | None = None  # set while the block is full and registered in the prefix cache


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups (vLLM's `PrefixCacheStats`): hits / queries is the hit rate, in tokens."""

    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found cached
    # Resumed (preempted) requests are counted apart: they mostly hit their own blocks, which flatters the rate.
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Count one lookup of `num_tokens` tokens that found `num_hits` cached."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """hits / queries over new requests (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """All blocks, the LRU free queue, and the hash -> block map of the prefix cache (vLLM's `BlockPool`)."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool):
        if num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        # Front = evicted first. Freed blocks go to the back, so the least recently used cached block is the
        # first to be reused. An OrderedDict gives vLLM's O(1) remove-from-the-middle (touching a cached block).
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        # Several blocks can carry the same hash (two requests computed the same prefix in one step); any serves.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    def get_num_free_blocks(self) -> int:
        """Blocks not held by any request (cached or not)."""
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's KV cache usage)."""
        return 1.0 - self.get_num_free_blocks() / self.num_gpu_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block holding this hash, or None."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]) -> None:
        """Register newly full blocks under their hashes, making them hits for later requests."""
        for block, block_hash in zip(blocks, block_hashes):
            assert block.block_hash is None, f"block {block.block_id} is cached twice"
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the front of the free queue, evicting their cached hashes (ref_cnt becomes 1)."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks out of {self.get_num_free_blocks()}")
        out = []
        for _ in range(num_blocks):
            _, block = self.free_block_queue.popitem(last=False)
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        # The block is about to hold other tokens: it must stop answering for its old hash.
        if block.block_hash is None:
            return
        same_hash = self.cached_block_hash_to_block.get(block.block_hash)
        if same_hash is not None:
            same_hash.pop(block.block_id, None)
            if not same_hash:
                del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks; a free one leaves the free queue so it cannot be evicted."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go to the back of the free queue in the given
        order (so the first ones given are evicted first). They keep their hash until evicted."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed more often than allocated"
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible while no request holds a block (vLLM returns False then)."""
        if self.get_num_free_blocks() != self.num_gpu_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True


class KVCacheManager:
    """Per-request block tables on top of a `BlockPool` (vLLM's `KVCacheManager` + single-type manager)."""

    def __init__(self, config: SchedulerConfig):
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.enable_caching = config.enable_prefix_caching
        self.block_pool = BlockPool(config.num_gpu_blocks, config.enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # req_id -> its blocks, in position order
        self.num_cached_block: dict[str, int] = {}  # req_id -> how many of its leading blocks are hashed
        self.prefix_cache_stats = PrefixCacheStats()  # cumulative since construction

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks held by nobody (cached ones included: they can be evicted)."""
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks for a request about to be (re)scheduled from scratch.

        Returns (blocks, num_computed_tokens). The hit is capped at `num_tokens - 1`: the last known token must
        be computed so the step produces the logits to sample from, even when the whole prompt is cached.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        block_hashes = update_block_hashes(request, self.block_size)
        max_cache_hit_length = request.num_tokens - 1
        computed: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_cache_hit_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # the chain hash makes every later block a miss too
            computed.append(block)
        num_hits = len(computed) * self.block_size
        self.prefix_cache_stats.record(request.num_tokens, num_hits, preempted=request.num_preemptions > 0)
        return computed, num_hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after `request.num_computed_tokens` (plus the cache-hit
        `new_computed_blocks` of a request being scheduled from scratch).

        Returns the ids of the newly allocated blocks ([] when the existing blocks have room), or None when the
        pool has too few free blocks; nothing changes then. Blocks that become full of known tokens with this
        step are hashed into the prefix cache right away, as vLLM does: the K/V will be there before any later
        step could read them.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        new_computed_blocks = list(new_computed_blocks or ())
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        if new_computed_blocks and req_blocks:
            raise ValueError(f"request {request.request_id} already holds blocks; cache hits are for fresh starts")
        num_computed_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens, self.max_model_len)
        num_required_blocks = -(-num_tokens_need_slot // self.block_size)
        num_new_blocks = max(num_required_blocks - len(new_computed_blocks) - len(req_blocks), 0)
        # A hit block that nobody holds sits in the free queue: taking it costs a free block too.
        num_evictable_computed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_computed > self.block_pool.get_num_free_blocks():
            return None

        if new_computed_blocks:
            assert self.enable_caching, "cache hits without prefix caching"
            # Touch before allocating, or get_new_blocks could evict the very blocks we hit.
            self.block_pool.touch(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(new_computed_blocks)  # already hashed
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        self.req_to_blocks[request.request_id] = req_blocks + new_computed_blocks + new_blocks

        if self.enable_caching:
            self._cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        # Hash the request's blocks that are full of known tokens once `num_tokens` are computed.
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        block_hashes = update_block_hashes(request, self.block_size)
        blocks = self.req_to_blocks[request.request_id]
        self.block_pool.cache_full_blocks(blocks[num_cached:num_full], block_hashes[num_cached:num_full])
        self.num_cached_block[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block of a finished or preempted request.

        Tail blocks are freed first (vLLM order), so they are evicted before the prefix blocks that other
        requests are more likely to share.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of a request: its block ids in position order."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks of `request_id` shared by all running requests (cascade attention's common prefix)."""
        count = 0
        for block in self.req_to_blocks.get(request_id, ()):
            if block.ref_cnt != num_running_requests:
                break
            count += 1
        return count

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash; False (nothing done) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()
