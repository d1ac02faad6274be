"""`Swap`: other token ids of the same shapes. Driven over a capture with prefix-cache hits, chunked prefill,
preemption and resume: every shape the runner sees stays as recorded, the ids a request found in the prefix cache
stay too, the rest change, and drafts and the tokens forced mode feeds back agree on every position."""

from __future__ import annotations

import msgspec
import pytest

from replay.capture import CaptureReader, Step
from replay.contracts import CachedRequestData, SchedulerOutput
from replay.errors import UsageError
from replay.replayer.swap import CONTENTS, Swap


def _steps(path) -> list[Step]:
    with CaptureReader(path) as r:
        return [x for x in r.records() if isinstance(x, Step)]


@pytest.mark.parametrize("kind", CONTENTS)
def test_every_shape_stays_and_only_the_swapped_requests_ids_change(keyed_capture, kind):
    steps = _steps(keyed_capture)
    new = [n for s in steps for n in s.scheduler_output.scheduled_new_reqs]
    ids = sorted({n.req_id for n in new})
    hitters = sorted({n.req_id for n in new if n.num_computed_tokens})
    swapped = {hitters[0], *ids[::3]}
    swap = Swap(dict.fromkeys(swapped, kind), vocab_size=512)
    hits, changed, kept_hit = 0, 0, 0
    for step in steps:
        so = step.scheduler_output
        out = swap.step(so)
        assert out.num_scheduled_tokens == so.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == so.total_num_scheduled_tokens
        for a, b in zip(so.scheduled_new_reqs, out.scheduled_new_reqs, strict=True):
            assert (a.req_id, a.block_ids, a.num_computed_tokens) == (b.req_id, b.block_ids, b.num_computed_tokens)
            assert len(a.prompt_token_ids) == len(b.prompt_token_ids)
            if a.req_id not in swapped:
                assert a.prompt_token_ids == b.prompt_token_ids
                continue
            hit = a.num_computed_tokens
            hits += hit > 0
            kept_hit += a.prompt_token_ids[:hit] == b.prompt_token_ids[:hit]
            changed += a.prompt_token_ids[hit:] != b.prompt_token_ids[hit:]
            assert all(0 <= t < 512 for t in b.prompt_token_ids[hit:])
        ca, cb = so.scheduled_cached_reqs, out.scheduled_cached_reqs
        assert (ca.req_ids, ca.new_block_ids, ca.num_computed_tokens, ca.resumed_req_ids) == \
            (cb.req_ids, cb.new_block_ids, cb.num_computed_tokens, cb.resumed_req_ids)
        for rid, toks in ca.all_token_ids.items():
            assert len(cb.all_token_ids[rid]) == len(toks)
        mro = step.model_runner_output
        if mro is not None:
            sampled = {r: t for r, t in zip(mro.req_ids, mro.sampled_token_ids) if t}
            fed = swap.sampled(sampled)
            assert {r: len(t) for r, t in fed.items()} == {r: len(t) for r, t in sampled.items()}
            assert all(fed[r] == t for r, t in sampled.items() if r not in swapped)
    assert changed == len(swapped) and kept_hit == len(swapped)
    assert hits >= 1  # a swapped request found part of its prompt in the prefix cache, and kept those ids
    assert swap.unseen() == []


def test_a_swapped_requests_drafts_take_the_ids_of_the_positions_it_then_samples():
    swap = Swap({"a": "random"}, vocab_size=1000, seed=3)
    from replay.contracts import NewRequestData, SamplingParams

    new = NewRequestData("a", [5, 6, 7], [], SamplingParams(temperature=0.0), None, ([0],), 0, None)
    empty = SchedulerOutput.make_empty()
    first = msgspec.structs.replace(empty, scheduled_new_reqs=[new], num_scheduled_tokens={"a": 3},
                                    total_num_scheduled_tokens=3)
    swap.step(first)
    [tok] = swap.sampled({"a": [9]})["a"]  # position 3
    cached = CachedRequestData(["a"], set(), [], {}, [None], [3], [1])
    decode = msgspec.structs.replace(empty, scheduled_cached_reqs=cached, num_scheduled_tokens={"a": 3},
                                     total_num_scheduled_tokens=3, scheduled_spec_decode_tokens={"a": [11, 12]})
    drafts = swap.step(decode).scheduled_spec_decode_tokens["a"]  # positions 4 and 5
    accepted = swap.sampled({"a": [11, 12, 13]})["a"]  # both drafts accepted, then the bonus token: positions 4-6
    assert accepted[:2] == drafts and len(set([tok, *accepted])) == 4


def test_contents_it_cannot_give_are_refused():
    with pytest.raises(UsageError, match="expected one of"):
        Swap({"a": "zeros"}, vocab_size=10)
