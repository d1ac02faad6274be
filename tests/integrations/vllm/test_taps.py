"""`gather_ranks`: what every tensor-parallel rank kept of a module's output, put together: whole where the ranks
agree, shards back in the unsharded column order (merged projections output by output)."""

from __future__ import annotations

import torch

from replay.integrations.vllm.taps import gather_ranks


def test_an_output_every_rank_holds_alike_is_whole_and_shards_are_put_back_in_column_order():
    whole = torch.arange(6.0).reshape(1, 6)
    full = torch.arange(8.0).reshape(1, 8)
    per_rank = [[("o_proj", whole, []), ("attn", full[:, :4], [])],
                [("o_proj", whole.clone(), []), ("attn", full[:, 4:], [])]]
    out = {m.name: m for m in gather_ranks(per_rank)}
    assert not out["o_proj"].gathered and torch.equal(out["o_proj"].rows, whole)
    assert out["attn"].gathered and torch.equal(out["attn"].rows, full)


def test_a_merged_projection_is_put_back_output_by_output():
    # qkv_proj at TP=1 lays out [q(4) | k(2) | v(2)]; each of two ranks holds [q half | k half | v half]
    q, k, v = torch.arange(4.0), torch.arange(10.0, 12.0), torch.arange(20.0, 22.0)
    rank0 = torch.cat([q[:2], k[:1], v[:1]]).reshape(1, 4)
    rank1 = torch.cat([q[2:], k[1:], v[1:]]).reshape(1, 4)
    (m,) = gather_ranks([[("qkv_proj", rank0, [4, 2, 2])], [("qkv_proj", rank1, [4, 2, 2])]])
    assert m.gathered and torch.equal(m.rows, torch.cat([q, k, v]).reshape(1, 8))


def test_what_only_the_first_rank_holds_is_taken_as_it_is():
    logits = torch.randn(1, 16)
    (m,) = gather_ranks([[("logits_processor", logits, [])], []])  # gathered to rank 0 only, as vLLM does
    assert not m.gathered and m.rows is logits


def test_kv_heads_copied_onto_several_ranks_are_taken_once():
    """One KV head at TP=2: vLLM copies it onto both ranks (`num_kv_head_replicas` 2, `output_sizes` [4, 4, 4]), and
    the TP=1 layout [q(4) | k(2) | v(2)] holds it once."""
    q, k, v = torch.arange(4.0), torch.arange(10.0, 12.0), torch.arange(20.0, 22.0)
    rank0 = torch.cat([q[:2], k, v]).reshape(1, 6)
    rank1 = torch.cat([q[2:], k, v]).reshape(1, 6)
    (m,) = gather_ranks([[("qkv_proj", rank0, [4, 4, 4], [1, 2, 2])], [("qkv_proj", rank1, [4, 4, 4], [1, 2, 2])]])
    assert m.gathered and torch.equal(m.rows, torch.cat([q, k, v]).reshape(1, 8))
