"""Paged attention over the KV cache, in two implementations selectable as a knob.

The model computes q, k, v for the flattened tokens of a step and calls `attend(layer, q, k, v)`. We write k and v
into the cache slots that each request's block table names (vLLM's `slot_mapping`), then attend each request's
queries to its whole context read back from the cache, so prefix-cache hits and earlier chunks are read exactly as
vLLM's kernels read them. Each request is attended on its own: attention is batch-invariant by construction; the
linear layers around it are not (that is what `bisect batch` hunts).

- `sdpa`: torch's scaled_dot_product_attention per request (fast).
- `reference`: plain math with the softmax in float64, for "which side is closer to the truth".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replay.engine.config import ATTENTION_IMPLS


class KVCache:
    """Per-layer K and V blocks: [num_blocks, block_size, num_kv_heads, head_dim] each, in the model dtype."""

    # Blocks are allocated as block ids appear, not all up front: a capture from an engine with a huge pool (vLLM on
    # CPU reserves 8192 blocks of 128 tokens per GiB) replays in the memory its steps actually touch.
    INITIAL_BLOCKS = 64

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (min(num_blocks, self.INITIAL_BLOCKS), block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks  # the pool's size: block ids must stay below it
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def ensure(self, block_id: int) -> None:
        """Grow the allocated blocks (doubling) so that `block_id` exists."""
        have = self.k[0].shape[0]
        if block_id < have:
            return
        if block_id >= self.num_blocks:
            raise ValueError(f"block id {block_id} outside the pool of {self.num_blocks} blocks")
        new = min(self.num_blocks, max(block_id + 1, 2 * have))
        grow = lambda t: torch.cat([t, t.new_zeros((new - have, *t.shape[1:]))])  # noqa: E731
        self.k = [grow(t) for t in self.k]
        self.v = [grow(t) for t in self.v]

    def slots(self, block_ids: list[int] | torch.Tensor, start: int, end: int,
              device: torch.device | str) -> torch.Tensor:
        """Flat slot indices of token positions [start, end) of a request with this block table."""
        pos = torch.arange(start, end, device=device)
        table = block_ids if isinstance(block_ids, torch.Tensor) else torch.tensor(block_ids, dtype=torch.long,
                                                                                  device=device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


@dataclass(slots=True)
class SeqSpan:
    """One request's part of a step: tokens [start, end) of the flat batch, at positions
    [num_computed, num_computed + end - start), attending to slots `context_slots` (its whole context)."""

    start: int
    end: int
    num_computed: int
    write_slots: torch.Tensor  # [end - start]
    context_slots: torch.Tensor  # [num_computed + end - start]


class PagedAttention:
    """The attention context of one step (the model calls `attend` once per layer)."""

    def __init__(self, kv: KVCache, spans: list[SeqSpan], impl: str = "sdpa", sliding_window: int | None = None,
                 per_token: bool = False):
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention implementation {impl!r}: expected one of {', '.join(ATTENTION_IMPLS)}")
        self.kv = kv
        self.spans = spans
        self.impl = impl
        self.sliding_window = sliding_window
        self.per_token = per_token  # batch-invariant mode: every query token attends on its own (see batch_invariant)
        self._write = torch.cat([s.write_slots for s in spans]) if spans else None
        # every request's context read in one gather per layer (not one per request), then sliced
        self._read = torch.cat([s.context_slots for s in spans]) if spans else None
        offsets = [0]
        for s in spans:
            offsets.append(offsets[-1] + len(s.context_slots))
        self._offsets = offsets

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]."""
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        flat_k = kc.view(-1, *kc.shape[2:])
        flat_v = vc.view(-1, *vc.shape[2:])
        flat_k[self._write] = k.to(kc.dtype)
        flat_v[self._write] = v.to(vc.dtype)
        out = torch.empty_like(q)
        # every request's context in one gather per layer, then per request a contiguous [H, ctx, D] copy with the
        # kv heads expanded (grouped-query attention: each kv head serves hq // hkv query heads); the fused
        # attention kernel wants contiguous inputs
        keys_all, values_all = flat_k[self._read], flat_v[self._read]  # [sum of contexts, Hkv, D]
        group = q.shape[1] // k.shape[1]
        qh = q.transpose(0, 1)  # [H, N, D]
        for i, s in enumerate(self.spans):
            a, b = self._offsets[i], self._offsets[i + 1]
            kh = keys_all[a:b].transpose(0, 1).repeat_interleave(group, dim=0)
            vh = values_all[a:b].transpose(0, 1).repeat_interleave(group, dim=0)
            if self.per_token:
                for t in range(s.end - s.start):
                    ctx = s.num_computed + t + 1  # the token at this position sees positions 0..itself
                    out[s.start + t] = self._one(qh[:, s.start + t:s.start + t + 1], kh[:, :ctx], vh[:, :ctx],
                                                 ctx - 1).transpose(0, 1)[0]
                continue
            out[s.start:s.end] = self._one(qh[:, s.start:s.end], kh, vh, s.num_computed).transpose(0, 1)
        return out

    def _mask(self, n: int, ctx: int, num_computed: int, device) -> torch.Tensor:
        qpos = torch.arange(num_computed, num_computed + n, device=device)[:, None]
        kpos = torch.arange(ctx, device=device)[None, :]
        mask = kpos <= qpos
        if self.sliding_window is not None:
            mask &= kpos > qpos - self.sliding_window
        return mask  # [n, ctx], True = attend

    def _one(self, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, num_computed: int) -> torch.Tensor:
        """One request: qh [H, n, D] against its context kh, vh [H, ctx, D] -> [H, n, D]."""
        n, d = qh.shape[1], qh.shape[2]
        ctx = kh.shape[1]
        if self.impl == "sdpa":
            # Fast paths without a mask tensor (torch then picks its fused kernels): a whole prefill is plain
            # causal, a decode token sees its whole context. Only a chunk after cached context needs the mask.
            window = self.sliding_window is not None and ctx > self.sliding_window
            if n == ctx and not window:
                mask, causal = None, True
            elif n == 1 and not window:
                mask, causal = None, False
            else:
                mask, causal = self._mask(n, ctx, num_computed, qh.device), False
            # 4-D inputs: torch's fused CPU kernel takes them (3-D falls back to the ~3x slower math path)
            return F.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=mask, is_causal=causal,
                                                  scale=d ** -0.5)[0]
        mask = self._mask(n, ctx, num_computed, qh.device)
        scores = (qh.double() @ kh.double().transpose(1, 2)) * d ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ vh.double()).to(qh.dtype)
