"""Paged attention over the KV cache, in three implementations selectable as a knob.

The model computes q, k, v for the flattened tokens of a step and calls `attend(layer, q, k, v)`. We write k and v
into the cache slots that each request's block table names (vLLM's `slot_mapping`), then attend each request's
queries to its whole context read back from the cache, so prefix-cache hits and earlier chunks are read exactly as
vLLM's kernels read them.

- `batched` (the default for new recordings): the short requests of a step (decodes, draft verification, small
  chunks) attend in one call per layer, their contexts and queries padded to the group's longest and the padding
  masked out, as transformers and vLLM batch them; long ones (prefills) attend alone, exactly as `sdpa` does. A
  request's attention then depends on its batch (the padded length changes the kernel's blocking), like the
  linear layers around it (what `bisect batch` hunts).
- `sdpa`: torch's scaled_dot_product_attention per request: batch-invariant by construction (the golden captures
  were recorded with it).
- `reference`: plain math per request with the softmax in float64, for "which side is closer to the truth".

The batch-invariant mode (`per_token`) attends one query token at a time whatever the implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from replay.engine.config import ATTENTION_IMPLS

# Query tokens above which a request attends alone under `batched`: padding a group to a long prefill would cost
# more than the call it saves (the fused CPU kernel's time grows with the padded query length).
SHORT = 16
# A group's longest context is at most PAD_RATIO times any member's, or at most MIN_KEYS: a decode reads its whole
# padded context (memory-bound), so one long context padding many short ones would cost more than the per-request calls.
PAD_RATIO = 1.5
MIN_KEYS = 128


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
        table = block_ids if isinstance(block_ids, torch.Tensor) else torch.tensor(block_ids, dtype=torch.long,
                                                                                  device=device)
        if end > len(table) * self.block_size:
            raise IndexError(f"position {end - 1} is past the {len(table)} blocks of the block table")
        # every slot of the table's blocks, then the positions asked: a third of the cost of indexing by position
        # (the runner asks once per request per step)
        every = table[:, None] * self.block_size + torch.arange(self.block_size, device=device)
        return every.view(-1)[start:end]


@dataclass(slots=True)
class SeqSpan:
    """One request's part of a step: tokens [start, end) of the flat batch, at positions
    [num_computed, num_computed + end - start), attending to slots `context_slots` (its whole context)."""

    start: int
    end: int
    num_computed: int
    write_slots: torch.Tensor  # [end - start]
    context_slots: torch.Tensor  # [num_computed + end - start]


class BatchGroup(NamedTuple):
    """Requests that attend in one call, padded to the group's longest query (nmax) and context (lmax).
    Grouped-query heads are folded into the query rows: row t * g + j of kv head h is query token t of query head
    h * g + j, so each kv head is read once, never copied per query head."""

    kv_index: torch.Tensor  # [B * Hkv * lmax] rows (slot * Hkv + head) of the cache seen as [slots * Hkv, D]:
    #                         request b's context per kv head, padded with slot 0 (masked)
    q_index: torch.Tensor  # [B * nmax] flat token rows: request b's queries, then its last one again as padding
    mask: torch.Tensor  # [B, 1, nmax * g, lmax] additive: 0 where the row's query may attend, -inf elsewhere
    rows: torch.Tensor  # [tokens of the group] row b * nmax + t of the padded output of each real query token
    tokens: torch.Tensor  # [tokens of the group] the flat batch row of each, in the same order
    nmax: int
    lmax: int


class PagedAttention:
    """The attention context of one step (the model calls `attend` once per layer)."""

    def __init__(self, kv: KVCache, spans: list[SeqSpan], impl: str = "batched", sliding_window: int | None = None,
                 per_token: bool = False):
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention implementation {impl!r}: expected one of {', '.join(ATTENTION_IMPLS)}")
        self.kv = kv
        self.spans = spans
        self.impl = impl
        self.sliding_window = sliding_window
        self.per_token = per_token  # batch-invariant mode: every query token attends on its own (see batch_invariant)
        short = [s for s in spans if s.end - s.start <= SHORT] if impl == "batched" and not per_token else []
        # a group of one request has nothing to share: it attends alone, exactly as sdpa would
        self._batches = [g for g in self._plan(short) if len(g) > 1]
        batched = {id(s) for g in self._batches for s in g}
        self._alone = [s for s in spans if id(s) not in batched]
        self._groups: list[BatchGroup] | None = None  # built at the first layer, which knows the head counts
        self._write = torch.cat([s.write_slots for s in spans]) if spans else None
        # the contexts of the requests attending alone, read in one gather per layer (not one per request), sliced
        self._read = torch.cat([s.context_slots for s in self._alone]) if self._alone else None
        offsets = [0]
        for s in self._alone:
            offsets.append(offsets[-1] + len(s.context_slots))
        self._offsets = offsets

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]."""
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        flat_k = kc.view(-1, *kc.shape[2:])
        flat_v = vc.view(-1, *vc.shape[2:])
        flat_k[self._write] = k.to(kc.dtype)
        flat_v[self._write] = v.to(vc.dtype)
        if self._batches:
            if self._groups is None:
                self._groups = [self._group(g, q.shape[1] // k.shape[1], kc.dtype) for g in self._batches]
            if not self._alone and len(self._groups) == 1:  # one group holding every token, in order
                return self._attend_group(self._groups[0], q, flat_k, flat_v)
            out = torch.empty_like(q)
            for grp in self._groups:
                out.index_copy_(0, grp.tokens, self._attend_group(grp, q, flat_k, flat_v))
        else:
            out = torch.empty_like(q)
        self._attend_alone(q, flat_k, flat_v, out)
        return out

    # -- requests on their own (sdpa, reference, the batch-invariant mode, and the long requests of batched) ---------

    def _attend_alone(self, q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, out: torch.Tensor) -> None:
        if not self._alone:
            return
        # every such request's context in one gather per layer (index_select: a copy, like indexing, but several
        # times faster on CPU), then per request a contiguous [H, ctx, D] copy with the kv heads expanded
        # (grouped-query attention: each kv head serves hq // hkv query heads); the fused kernel wants contiguous
        keys_all, values_all = flat_k.index_select(0, self._read), flat_v.index_select(0, self._read)
        group = q.shape[1] // flat_k.shape[1]
        qh = q.transpose(0, 1)  # [H, N, D]
        for i, s in enumerate(self._alone):
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
        if self.impl != "reference":  # sdpa, and batched's requests that attend alone
            # Fast paths without a mask tensor (torch then picks its fused kernels): a whole prefill is plain
            # causal, a decode token sees its whole context. Only a chunk after cached context needs the mask.
            window = self.sliding_window is not None and ctx > self.sliding_window
            if n == ctx and not window:
                mask, causal = None, True
            elif n == 1 and not window:
                mask, causal = None, False
            else:
                mask, causal = self._mask(n, ctx, num_computed, qh.device), False
            # 4-D inputs: torch's fused CPU kernel takes them (3-D falls back to the slower math path)
            return F.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=mask, is_causal=causal,
                                                  scale=d ** -0.5)[0]
        mask = self._mask(n, ctx, num_computed, qh.device)
        scores = (qh.double() @ kh.double().transpose(1, 2)) * d ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ vh.double()).to(qh.dtype)

    # -- batched: one call per group of short requests ----------------------------------------------------------------

    @staticmethod
    def _plan(short: list[SeqSpan]) -> list[list[SeqSpan]]:
        """Group the short requests so that padding at most doubles the queries (one power-of-two bracket per
        group: 1 (the decodes), 2, 3-4, 5-8, 9-16) and bounds the context padding (PAD_RATIO, MIN_KEYS)."""
        bracket = lambda s: (s.end - s.start - 1).bit_length()  # noqa: E731
        groups: list[list[SeqSpan]] = []
        for s in sorted(short, key=lambda s: (bracket(s), -len(s.context_slots))):  # longest context first
            head = groups[-1][0] if groups else None
            if head is None or bracket(head) != bracket(s) or \
                    len(head.context_slots) > max(PAD_RATIO * len(s.context_slots), MIN_KEYS):
                groups.append([])
            groups[-1].append(s)
        # batch order within a group: one group of every request gives the output rows in order, with no scatter
        return [sorted(g, key=lambda s: s.start) for g in groups]

    def _group(self, spans: list[SeqSpan], group: int, dtype: torch.dtype) -> BatchGroup:
        """A group's gather indices, padded query rows and mask (`group`: query heads per kv head), once per step."""
        dev = spans[0].context_slots.device
        lens = torch.tensor([s.end - s.start for s in spans], device=dev)  # [B] query tokens
        starts = torch.tensor([s.start for s in spans], device=dev)
        computed = torch.tensor([s.num_computed for s in spans], device=dev)
        nmax, lmax = max(s.end - s.start for s in spans), max(len(s.context_slots) for s in spans)
        # slot 0 pads every context: it exists whatever the pool, and the mask hides it
        slots = pad_sequence([s.context_slots for s in spans], batch_first=True)  # [B, lmax]
        # gathered head-major ([B, Hkv, lmax, D], each head's keys contiguous): the fused CPU kernel runs ~30 %
        # faster on that than on the cache's [B, lmax, Hkv, D] order, and the gather costs the same
        hkv = self.kv.k[0].shape[2]
        kv_index = slots[:, None, :] * hkv + torch.arange(hkv, device=dev)[None, :, None]  # [B, Hkv, lmax]
        t = torch.arange(nmax, device=dev)
        # a padding query repeats its request's last one, so no row of the mask is empty (an all -inf row is NaN)
        last = torch.minimum(t[None, :], lens[:, None] - 1)  # [B, nmax]
        qpos = (computed[:, None] + last)[..., None]  # [B, nmax, 1] the position of each query
        kpos = torch.arange(lmax, device=dev)
        # causal, which also hides each context's padding: a query's position is below its context length
        allowed = kpos <= qpos
        if self.sliding_window is not None:
            allowed &= kpos > qpos - self.sliding_window
        mask = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, float("-inf"))
        rows = (t[None, :] < lens[:, None]).reshape(-1).nonzero().squeeze(1)  # the real queries, in batch order
        q_index = (starts[:, None] + last).reshape(-1)
        return BatchGroup(kv_index.reshape(-1), q_index, mask.repeat_interleave(group, dim=1)[:, None], rows,
                          q_index[rows], nmax, lmax)

    def _attend_group(self, grp: BatchGroup, q: torch.Tensor, flat_k: torch.Tensor,
                      flat_v: torch.Tensor) -> torch.Tensor:
        """One call for a group: [tokens of the group, Hq, D], in the order of `grp.tokens`."""
        hq, hkv, d = q.shape[1], flat_k.shape[1], q.shape[2]
        b, nmax, lmax, g = len(grp.kv_index) // (hkv * grp.lmax), grp.nmax, grp.lmax, hq // hkv
        keys = flat_k.view(-1, d).index_select(0, grp.kv_index).view(b, hkv, lmax, d)
        values = flat_v.view(-1, d).index_select(0, grp.kv_index).view(b, hkv, lmax, d)
        # [B * nmax, Hq, D] -> [B, Hkv, nmax * g, D]: each kv head's query heads as extra query rows
        qf = q.index_select(0, grp.q_index).view(b, nmax, hkv, g, d).transpose(1, 2).reshape(b, hkv, nmax * g, d)
        o = F.scaled_dot_product_attention(qf, keys, values, attn_mask=grp.mask, scale=d ** -0.5)
        o = o.view(b, hkv, nmax, g, d).transpose(1, 2).reshape(b * nmax, hq, d)
        return o.index_select(0, grp.rows)
