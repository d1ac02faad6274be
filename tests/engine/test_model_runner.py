"""Model runner: paged attention equals a contiguous forward; vLLM's state-diff semantics step by step."""

from __future__ import annotations

import pytest
import torch

from replay.contracts import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from replay.engine.model import ContiguousAttention
from replay.engine.model_runner import ModelRunner
from replay.engine.weights import tiny_model
from replay.errors import UsageError
from replay.provenance import set_torch_threads

BS = 4  # block size: small, so requests span several blocks


@pytest.fixture(scope="module")
def model():
    set_torch_threads(1)
    m, _, _ = tiny_model()
    return m


def contiguous_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """Raw logprobs of the next token after `tokens`, from one contiguous forward pass."""
    with torch.inference_mode():
        h = model(torch.tensor(tokens), torch.arange(len(tokens)), ContiguousAttention([len(tokens)]))
        return torch.log_softmax(model.compute_logits(h[-1:]), dim=-1)[0]


def new(rid, prompt, blocks, computed=0, **sp):
    params = SamplingParams(**{"temperature": 0.0, "logprobs": 5, **sp})
    return NewRequestData(rid, prompt, [], params, None, (blocks,), computed, None)


def so(new_reqs=(), cached=None, sched=None, finished=()):
    cached = cached or CachedRequestData.make_empty()
    sched = sched or {}
    return SchedulerOutput(list(new_reqs), cached, sched, sum(sched.values()), {}, {}, set(finished), [])


def cached(ids, computed, new_blocks=None, resumed=(), outputs=None):
    return CachedRequestData(list(ids), set(resumed), [], {}, new_blocks or [None] * len(ids), list(computed),
                             outputs or [1] * len(ids))


def top(out, i=0):
    lp = out.logprobs
    return lp.logprob_token_ids.to_numpy()[i], torch.from_numpy(lp.logprobs.to_numpy()[i])


def check_against_contiguous(model, out, row, tokens):
    ref = contiguous_logprobs(model, tokens)
    ids, vals = top(out, row)
    assert ids[0] == int(ref.argmax())
    assert torch.allclose(vals, ref[torch.from_numpy(ids).long()], atol=1e-5)


def test_prefill_decode_and_chunked_prefill_equal_the_contiguous_forward(model):
    r = ModelRunner(model, num_blocks=32, block_size=BS)
    prompt = list(range(3, 14))  # 11 tokens: 3 blocks
    out = r.execute_model(so([new("a", prompt, [5, 9, 2])], sched={"a": 11}))
    check_against_contiguous(model, out, 0, prompt)
    seq = prompt + out.sampled_token_ids[0]
    for step in range(6):  # decode through the paged cache, crossing block boundaries
        n = len(seq) - 1
        blocks = [[12 + n // BS]] if n % BS == 0 else None  # a fresh block each time one fills up
        out = r.execute_model(so(cached=cached(["a"], [n], [(blocks[0],)] if blocks else None,
                                               outputs=[len(seq) - len(prompt)]), sched={"a": 1}))
        check_against_contiguous(model, out, 0, seq)
        seq += out.sampled_token_ids[0]

    chunked = ModelRunner(model, num_blocks=32, block_size=BS)
    first = chunked.execute_model(so([new("b", prompt, [1, 2])], sched={"b": 6}))
    assert first.sampled_token_ids == [[]]  # a partial prefill chunk samples nothing
    out = chunked.execute_model(so(cached=cached(["b"], [6], [([3],)], outputs=[0]), sched={"b": 5}))
    check_against_contiguous(model, out, 0, prompt)


def test_prefix_cache_hit_reads_blocks_another_request_wrote(model):
    r = ModelRunner(model, num_blocks=32, block_size=BS)
    shared = list(range(40, 48))  # two full blocks
    r.execute_model(so([new("a", shared + [50, 51], [0, 1, 2])], sched={"a": 10}))
    # b shares a's first two blocks (ids 0 and 1) and computes only its own tail
    tail = [60, 61, 62]
    out = r.execute_model(so([new("b", shared + tail, [0, 1, 3], computed=8)], cached=cached(["a"], [10]),
                             sched={"b": 3, "a": 1}))
    check_against_contiguous(model, out, out.req_id_to_index["b"], shared + tail)


def test_batch_rows_are_independent_requests(model):
    r = ModelRunner(model, num_blocks=32, block_size=BS)
    p1, p2 = list(range(3, 10)), list(range(100, 105))
    out = r.execute_model(so([new("x", p1, [0, 1]), new("y", p2, [2, 3])], sched={"x": 7, "y": 5}))
    assert out.req_ids == ["x", "y"] and out.req_id_to_index == {"x": 0, "y": 1}
    check_against_contiguous(model, out, 0, p1)
    check_against_contiguous(model, out, 1, p2)


def test_finished_and_unscheduled_requests(model):
    r = ModelRunner(model, num_blocks=32, block_size=BS)
    r.execute_model(so([new("x", [3, 4, 5], [0]), new("y", [6, 7], [1])], sched={"x": 3, "y": 2}))
    # y is not scheduled (preempted or skipped): it leaves the batch but keeps its state
    out = r.execute_model(so(cached=cached(["x"], [3]), sched={"x": 1}))
    assert out.req_ids == ["x"] and "y" in r.requests
    # x finishes: its state is dropped; y is resumed with a replacement block table and re-prefilled
    out = r.execute_model(so(cached=cached(["y"], [0], [([9],)], resumed=["y"]), sched={"y": 3}, finished=["x"]))
    assert "x" not in r.requests and r.requests["y"].block_ids == [9]
    check_against_contiguous(model, out, 0, [6, 7] + r.requests["y"].output_token_ids[:1])


def test_unknown_cached_request_means_no_clean_boundary(model):
    r = ModelRunner(model, num_blocks=8, block_size=BS)
    with pytest.raises(UsageError, match="clean step boundary"):
        r.execute_model(so(cached=cached(["ghost"], [5]), sched={"ghost": 1}))


def test_unseeded_random_requests_get_recorded_seeds(model):
    r = ModelRunner(model, num_blocks=8, block_size=BS, seed=3)
    out = r.execute_model(so([new("u", [3, 4], [0], temperature=1.0)], sched={"u": 2}))
    seeds = dict(r.last_drawn_seeds)
    assert set(seeds) == {"u"}
    again = ModelRunner(model, num_blocks=8, block_size=BS, seed=999)  # another engine seed...
    out2 = again.execute_model(so([new("u", [3, 4], [0], temperature=1.0)], sched={"u": 2}), drawn_seeds=seeds)
    assert out2.sampled_token_ids == out.sampled_token_ids  # ...same token with the recorded seed


def test_snapshots_keep_how_many_tokens_each_request_emitted_last(model):
    """Forced mode replaces the tokens a request emitted in the step before (several with accepted drafts): a
    bisect that restores a snapshot mid-capture must replace as many as the recording had then, not as its last
    re-execution emitted."""
    r = ModelRunner(model, num_blocks=32, block_size=BS)
    r.execute_model(so([new("a", [1, 2, 3, 4, 5], [0, 1])], sched={"a": 5}))
    r.last_emitted = {"a": 3}  # as after a step that accepted two drafts
    whole, step = r.snapshot(), r.snapshot_step(so(cached=cached(["a"], [5]), sched={"a": 1}))
    r.execute_model(so(cached=cached(["a"], [5]), sched={"a": 1}))
    assert r.last_emitted == {"a": 1}
    r.restore_step(step)
    assert r.last_emitted == {"a": 3}
    r.last_emitted = {"a": 1}
    r.restore(whole)
    assert r.last_emitted == {"a": 3}
