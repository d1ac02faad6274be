"""The scheduler and KV cache manager, driven by a fake runner (no model).

`FakeRunner` applies each SchedulerOutput the way vLLM's V1 runner does (a diff against its cached state) and
keeps a toy KV cache that stores the token id written at each slot. Every step it checks that each scheduled
request reads back exactly its own tokens from its block table, so a wrong block id, a bad prefix-cache hit or a
block handed to two requests shows up as a wrong token, not as a silently wrong test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from replay.contracts import (
    Array,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    RequestStatus,
    SamplingParams,
    SchedulerOutput,
)
from replay.engine.config import SchedulerConfig
from replay.engine.kv_cache_manager import (
    KVCacheManager,
    hash_block_tokens,
    update_block_hashes,
)
from replay.engine.request import Request
from replay.engine.scheduler import Scheduler

EOS = 2


def make_ecr(rid: str, prompt: list[int], cache_salt: str | None = None, **sp) -> EngineCoreRequest:
    """An EngineCoreRequest as the frontend would send it."""
    return EngineCoreRequest(rid, list(prompt), None, SamplingParams(**sp), None, 0.0, None, cache_salt, None,
                             external_req_id=rid)


def config(**kw) -> SchedulerConfig:
    """Small blocks and budgets so every mechanism shows up in a few steps."""
    base = dict(block_size=4, num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    base.update(kw)
    return SchedulerConfig(**base)


def prompt(start: int, n: int) -> list[int]:
    """n distinct token ids from `start` (distinct tokens make any KV mix-up visible)."""
    return list(range(start, start + n))


@dataclass
class _ReqState:
    tokens: list[int]
    num_prompt: int
    block_ids: list[int]
    num_computed: int
    preempted: bool = False


@dataclass
class FakeRunner:
    """Applies SchedulerOutputs like vLLM's V1 runner, over a KV cache of token ids; samples `next_token`."""

    block_size: int
    num_blocks: int
    # (req_id, index of the output token) -> token; default: distinct per request, never EOS
    next_token: Callable[[str, int], int] = lambda rid, i: 1000 + 100 * (sum(map(ord, rid)) % 50) + i
    reqs: dict[str, _ReqState] = field(default_factory=dict)
    kv: list[list[int | None]] = field(default_factory=list)
    # a write into a block another request holds fails at once; off where a request in the same step may hit a block
    # another one computes in it (vLLM caches a block when it is allocated): the reads still check its content
    exclusive_writes: bool = True

    def __post_init__(self):
        self.kv = [[None] * self.block_size for _ in range(self.num_blocks)]

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for rid in so.preempted_req_ids or ():
            self.reqs[rid].preempted = True  # its blocks belong to the pool again
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs
            self.reqs[new.req_id] = _ReqState(list(new.prompt_token_ids), len(new.prompt_token_ids),
                                              list(new.block_ids[0]), new.num_computed_tokens)
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            st = self.reqs[rid]
            st.num_computed = cr.num_computed_tokens[i]
            assert cr.num_output_tokens[i] == len(st.tokens) - st.num_prompt
            new_blocks = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                assert st.preempted and new_blocks is not None
                st.block_ids, st.preempted = list(new_blocks[0]), False
            elif new_blocks is not None:
                assert not st.preempted
                st.block_ids.extend(new_blocks[0])
        req_ids = so.scheduled_req_ids()
        assert sorted(req_ids) == sorted(so.num_scheduled_tokens)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        # write every scheduled token's "K/V" first (as attention does per layer), then check every read
        for rid in req_ids:
            st, n = self.reqs[rid], so.num_scheduled_tokens[rid]
            assert st.num_computed + n <= len(st.tokens), "scheduled past the known tokens"
            assert len(st.block_ids) * bs >= st.num_computed + n, "no slot for a scheduled token"
            for p in range(st.num_computed, st.num_computed + n):
                block = st.block_ids[p // bs]
                for other_id, other in self.reqs.items() if self.exclusive_writes else ():
                    assert other_id == rid or other.preempted or block not in other.block_ids, \
                        f"{rid} writes block {block} that {other_id} still holds"
                self.kv[block][p % bs] = st.tokens[p]
        for rid in req_ids:
            st, n = self.reqs[rid], so.num_scheduled_tokens[rid]
            got = [self.kv[st.block_ids[p // bs]][p % bs] for p in range(st.num_computed + n)]
            assert got == st.tokens[:st.num_computed + n], f"{rid} reads a wrong context"
        sampled = []
        for rid in req_ids:
            st = self.reqs[rid]
            st.num_computed += so.num_scheduled_tokens[rid]
            if st.num_computed == len(st.tokens):  # reached the end of its known tokens: sample
                tok = self.next_token(rid, len(st.tokens) - st.num_prompt)
                st.tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])  # partial prefill chunk
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def make(cfg: SchedulerConfig, **runner_kw) -> tuple[Scheduler, FakeRunner]:
    return Scheduler(cfg, eos_token_id=EOS), FakeRunner(cfg.block_size, cfg.num_gpu_blocks, **runner_kw)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    so = sched.schedule()
    assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    return so, sched.update_from_output(so, runner.execute_model(so))


def run_to_end(sched: Scheduler, runner: FakeRunner, max_steps: int = 500):
    """Step until nothing is left; returns (steps, outputs per request, finish reason per request)."""
    steps, tokens, reasons = [], {}, {}
    while sched.has_requests():
        so, out = step(sched, runner)
        steps.append((so, out))
        for o in out.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.request_id not in reasons, "finished twice"
                reasons[o.request_id] = o.finish_reason
        assert len(steps) < max_steps, "scheduler does not make progress"
    return steps, tokens, reasons


def assert_pool_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == sched.config.num_gpu_blocks and kv.usage == 0.0
    assert not kv.req_to_blocks and all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


# -- budgets and chunking --------------------------------------------------------------------------------------------


def test_long_prefill_is_chunked_to_the_token_budget_and_partial_chunks_yield_nothing():
    sched, runner = make(config(max_num_batched_tokens=8))
    sched.add_request(make_ecr("a", prompt(10, 20), max_tokens=3))
    so, out = step(sched, runner)
    [new] = so.scheduled_new_reqs
    assert so.num_scheduled_tokens == {"a": 8} and new.num_computed_tokens == 0
    assert new.block_ids == ([0, 1],)  # slots for 8 tokens, and only those
    assert out.outputs == []  # a partial prefill chunk samples nothing
    so, out = step(sched, runner)
    cr = so.scheduled_cached_reqs
    assert cr.req_ids == ["a"] and cr.num_computed_tokens == [8] and cr.new_block_ids == [([2, 3],)]
    assert cr.resumed_req_ids == set() and cr.new_token_ids == [] and cr.all_token_ids == {}
    assert so.num_scheduled_tokens == {"a": 8} and out.outputs == []
    so, out = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_cached_reqs.num_computed_tokens == [16]
    assert [o.new_token_ids for o in out.outputs] == [[runner.next_token("a", 0)]]
    assert sched.get_request("a").num_computed_tokens == 20 and sched.get_request("a").num_tokens == 21


def test_decode_steps_schedule_one_token_and_allocate_only_at_block_boundaries():
    sched, runner = make(config())
    sched.add_request(make_ecr("a", prompt(10, 6), max_tokens=5))
    step(sched, runner)  # prefill 6 tokens: blocks for positions 0..7
    new_blocks = []
    for _ in range(4):
        so, _ = step(sched, runner)
        assert so.num_scheduled_tokens == {"a": 1}
        new_blocks.append(so.scheduled_cached_reqs.new_block_ids[0])
    # positions 6, 7 fit the second block; position 8 needs a third
    assert new_blocks[0] is None and new_blocks[1] is None and new_blocks[2] == ([2],) and new_blocks[3] is None


def test_running_requests_are_served_first_and_the_budget_is_never_exceeded():
    sched, runner = make(config(max_num_batched_tokens=10))
    sched.add_request(make_ecr("a", prompt(10, 7), max_tokens=4))
    sched.add_request(make_ecr("b", prompt(30, 7), max_tokens=4))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 7, "b": 3}  # b's prefill is chunked to the rest of the budget
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 4}  # running ones in order: a decodes, b finishes its prefill
    steps, tokens, reasons = run_to_end(sched, runner)
    assert all(so.total_num_scheduled_tokens <= 10 for so, _ in steps)
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert_pool_free(sched)


def test_max_num_seqs_caps_the_running_requests():
    sched, runner = make(config(max_num_seqs=2))
    for i in range(4):
        sched.add_request(make_ecr(f"r{i}", prompt(10 * i + 10, 5), max_tokens=3))
    so, _ = step(sched, runner)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["r0", "r1"]
    assert sched.get_request_counts() == (2, 2)
    steps, _, reasons = run_to_end(sched, runner)
    assert all(len(so.num_scheduled_tokens) <= 2 for so, _ in steps)
    assert set(reasons) == {"r0", "r1", "r2", "r3"}


def test_chunked_prefill_off_waits_for_a_budget_that_holds_the_whole_prompt():
    sched, runner = make(config(max_num_batched_tokens=12, enable_chunked_prefill=False))
    sched.add_request(make_ecr("a", prompt(10, 8), max_tokens=2))
    sched.add_request(make_ecr("b", prompt(30, 8), max_tokens=2))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 8}  # b (8 > 4 left) is not chunked, it waits
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 8}


# -- prefix caching --------------------------------------------------------------------------------------------------


def test_shared_prompt_prefix_is_a_cache_hit_of_whole_blocks():
    sched, runner = make(config())
    shared = prompt(10, 9)
    sched.add_request(make_ecr("a", shared + [50, 51], max_tokens=5))
    step(sched, runner)
    sched.add_request(make_ecr("b", shared + [60, 61, 62], max_tokens=2))
    so, _ = step(sched, runner)
    [new] = so.scheduled_new_reqs
    a_blocks = sched.kv_cache_manager.get_block_ids("a")
    assert new.num_computed_tokens == 8  # 2 full blocks of the 9 shared tokens
    assert new.block_ids[0][:2] == a_blocks[:2] and so.num_scheduled_tokens["b"] == 12 - 8
    stats = sched.make_stats().prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 11 + 12, 8)
    run_to_end(sched, runner)
    assert_pool_free(sched)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched, runner = make(config())
    sched.add_request(make_ecr("a", prompt(10, 8), max_tokens=1))
    run_to_end(sched, runner)  # a is done; its two full blocks stay cached in the free queue
    sched.add_request(make_ecr("b", prompt(10, 8), max_tokens=1))
    so, out = step(sched, runner)
    [new] = so.scheduled_new_reqs
    assert new.num_computed_tokens == 4  # capped at num_tokens - 1 = 7, i.e. one whole block
    assert so.num_scheduled_tokens == {"b": 4} and out.outputs[0].new_token_ids


def test_prompt_logprobs_skip_reading_the_prefix_cache_unless_told_otherwise():
    sched, runner = make(config())
    sched.add_request(make_ecr("a", prompt(10, 12), max_tokens=1))
    run_to_end(sched, runner)
    sched.add_request(make_ecr("b", prompt(10, 12), max_tokens=1, prompt_logprobs=2))
    sched.add_request(make_ecr("c", prompt(10, 12), max_tokens=1, skip_reading_prefix_cache=True))
    sched.add_request(make_ecr("d", prompt(10, 12), max_tokens=1, prompt_logprobs=2,
                               skip_reading_prefix_cache=False))
    so, _ = step(sched, runner)
    assert {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs} == {"b": 0, "c": 0, "d": 8}


def test_cache_salt_keeps_equal_prompts_apart():
    sched, runner = make(config())
    sched.add_request(make_ecr("a", prompt(10, 12), max_tokens=1, cache_salt="tenant-1"))
    run_to_end(sched, runner)
    sched.add_request(make_ecr("b", prompt(10, 12), max_tokens=1, cache_salt="tenant-2"))
    sched.add_request(make_ecr("c", prompt(10, 12), max_tokens=1, cache_salt="tenant-1"))
    so, _ = step(sched, runner)
    assert {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs} == {"b": 0, "c": 8}


def test_no_prefix_caching_means_no_hits():
    sched, runner = make(config(enable_prefix_caching=False))
    sched.add_request(make_ecr("a", prompt(10, 12), max_tokens=1))
    run_to_end(sched, runner)
    sched.add_request(make_ecr("b", prompt(10, 12), max_tokens=1))
    so, _ = step(sched, runner)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


def test_output_tokens_become_cacheable_once_their_block_is_full():
    sched, runner = make(config())
    sched.add_request(make_ecr("a", prompt(10, 6), max_tokens=6))
    _, tokens, _ = run_to_end(sched, runner)
    # a's known tokens: 6 prompt + 6 sampled; the last one was never computed, blocks 0..1 (8 tokens) are cached
    sched.add_request(make_ecr("b", prompt(10, 6) + tokens["a"][:4], max_tokens=1))
    so, _ = step(sched, runner)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8


def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first():
    cfg = config(num_gpu_blocks=4, max_model_len=16)
    kv = KVCacheManager(cfg)
    a = Request.from_engine_core_request(make_ecr("a", prompt(10, 9), max_tokens=1), EOS)
    assert kv.allocate_slots(a, 9) == [0, 1, 2]
    kv.free(a)  # tail first: the free queue is now 3, 2, 1, 0 (block 2 is partial, never cached)
    assert [b.block_id for b in kv.block_pool.free_block_queue.values()] == [3, 2, 1, 0]
    b = Request.from_engine_core_request(make_ecr("b", prompt(90, 5), max_tokens=1), EOS)
    assert kv.allocate_slots(b, 5) == [3, 2]  # no cached block had to be evicted
    a2 = Request.from_engine_core_request(make_ecr("a2", prompt(10, 9), max_tokens=1), EOS)
    blocks, n = kv.get_computed_blocks(a2)
    assert [blk.block_id for blk in blocks] == [0, 1] and n == 8
    c = Request.from_engine_core_request(make_ecr("c", prompt(70, 4), max_tokens=1), EOS)
    assert kv.allocate_slots(c, 4) == [1]  # LRU: block 1 (a's second block) was freed before block 0
    blocks, n = kv.get_computed_blocks(a2)
    assert [blk.block_id for blk in blocks] == [0] and n == 4


def test_common_prefix_blocks_count_blocks_every_running_request_holds():
    sched, runner = make(config())
    shared = prompt(10, 8)
    sched.add_request(make_ecr("a", shared + [50], max_tokens=4))
    step(sched, runner)
    sched.add_request(make_ecr("b", shared + [60], max_tokens=4))
    so, _ = step(sched, runner)
    assert so.num_common_prefix_blocks == [2]


# -- preemption ------------------------------------------------------------------------------------------------------


def test_out_of_blocks_preempts_the_last_request_which_later_resumes_and_reprefills():
    # 6 blocks of 4 slots; two requests of 8 + 12 tokens need 5 blocks each at the end
    cfg = config(num_gpu_blocks=6, enable_prefix_caching=False)
    sched, runner = make(cfg)
    sched.add_request(make_ecr("a", prompt(10, 8), max_tokens=12))
    sched.add_request(make_ecr("b", prompt(30, 8), max_tokens=12))
    steps, tokens, reasons = run_to_end(sched, runner)
    preempting = [i for i, (so, _) in enumerate(steps) if so.preempted_req_ids]
    assert preempting and steps[preempting[0]][0].preempted_req_ids == {"b"}
    so, _ = steps[preempting[0]]
    assert "b" not in so.num_scheduled_tokens and "b" not in so.finished_req_ids
    assert so.scheduled_new_reqs == []  # no admissions in a step that preempted
    resumed = next(i for i, (so, _) in enumerate(steps) if "b" in so.scheduled_cached_reqs.resumed_req_ids)
    so = steps[resumed][0]
    cr = so.scheduled_cached_reqs
    i = cr.req_ids.index("b")
    num_known = 8 + cr.num_output_tokens[i]
    assert cr.num_computed_tokens[i] == 0 and so.num_scheduled_tokens["b"] == num_known  # everything recomputed
    assert len(cr.new_block_ids[i][0]) == -(-num_known // 4)  # a whole replacement table
    assert cr.all_token_ids["b"][:8] == prompt(30, 8) and len(cr.all_token_ids["b"]) == num_known
    # preemption changes when tokens are computed, never which tokens
    assert tokens == {r: [runner.next_token(r, k) for k in range(12)] for r in ("a", "b")}
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert sched.make_stats().num_preemptions >= 1
    assert_pool_free(sched)


def test_a_request_alone_in_a_full_pool_preempts_itself_and_comes_back():
    cfg = config(num_gpu_blocks=4, enable_prefix_caching=False)
    sched, runner = make(cfg)
    sched.add_request(make_ecr("a", prompt(10, 4), max_tokens=9))  # up to 13 tokens: 4 blocks
    sched.add_request(make_ecr("b", prompt(30, 4), max_tokens=1))
    steps, tokens, reasons = run_to_end(sched, runner)
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH} and len(tokens["a"]) == 9
    assert_pool_free(sched)


def test_resumed_request_hits_its_own_cached_blocks():
    cfg = config(num_gpu_blocks=6)
    sched, runner = make(cfg)
    sched.add_request(make_ecr("a", prompt(10, 8), max_tokens=12))
    sched.add_request(make_ecr("b", prompt(30, 8), max_tokens=12))
    steps, tokens, _ = run_to_end(sched, runner)
    resumed = [so for so, _ in steps if so.scheduled_cached_reqs.resumed_req_ids]
    assert resumed  # FakeRunner verified that every hit block held the right tokens
    assert sched.make_stats().prefix_cache_stats.preempted_requests >= 1
    assert tokens == {r: [runner.next_token(r, k) for k in range(12)] for r in ("a", "b")}
    assert_pool_free(sched)


# -- finishing ---------------------------------------------------------------------------------------------------------


def eos_at(k: int, rid_filter: str | None = None) -> Callable[[str, int], int]:
    """A runner policy sampling EOS as output token k (for every request, or only `rid_filter`)."""
    return lambda rid, i: EOS if i == k and (rid_filter is None or rid == rid_filter) else 500 + i


def test_eos_stops_with_no_stop_reason_and_is_reported_once_on_the_next_schedule():
    sched, runner = make(config(), next_token=eos_at(2))
    sched.add_request(make_ecr("a", prompt(10, 5), max_tokens=10))
    outs = [step(sched, runner) for _ in range(3)]
    last = outs[-1][1]
    [o] = last.outputs
    assert o.new_token_ids == [EOS] and o.finish_reason == FinishReason.STOP and o.stop_reason is None
    assert last.finished_requests == {"a"} and sched.get_request("a") is None
    assert sched.has_requests()  # the runner still has to hear about it
    so, out = step(sched, runner)
    assert so.finished_req_ids == {"a"} and so.total_num_scheduled_tokens == 0 and out.outputs == []
    assert not sched.has_requests()
    assert sched.schedule().finished_req_ids == set()
    assert_pool_free(sched)


def test_stop_token_ids_stop_with_the_token_as_stop_reason():
    sched, runner = make(config(), next_token=lambda rid, i: 500 + i)
    sched.add_request(make_ecr("a", prompt(10, 5), max_tokens=10, stop_token_ids=[503]))
    _, tokens, reasons = run_to_end(sched, runner)
    assert tokens["a"] == [500, 501, 502, 503] and reasons["a"] == FinishReason.STOP


def test_ignore_eos_and_per_request_eos():
    sched, runner = make(config(), next_token=eos_at(1))
    sched.add_request(make_ecr("ignore", prompt(10, 5), max_tokens=4, ignore_eos=True))
    sched.add_request(make_ecr("own-eos", prompt(30, 5), max_tokens=4, eos_token_id=502))
    _, tokens, reasons = run_to_end(sched, runner)
    assert tokens["ignore"] == [500, EOS, 502, 503] and reasons["ignore"] == FinishReason.LENGTH
    assert tokens["own-eos"] == [500, EOS, 502] and reasons["own-eos"] == FinishReason.STOP


def test_min_tokens_hold_back_every_stop_condition():
    sched, runner = make(config(), next_token=lambda rid, i: EOS)
    sched.add_request(make_ecr("a", prompt(10, 5), max_tokens=10, min_tokens=3))
    _, tokens, reasons = run_to_end(sched, runner)
    assert tokens["a"] == [EOS, EOS, EOS] and reasons["a"] == FinishReason.STOP


def test_max_tokens_and_max_model_len_cap_the_length():
    sched, runner = make(config(max_model_len=12))
    sched.add_request(make_ecr("short", prompt(10, 5), max_tokens=3))
    sched.add_request(make_ecr("long", prompt(30, 5), max_tokens=None))
    sched.add_request(make_ecr("full", prompt(50, 12), max_tokens=5))
    steps, tokens, reasons = run_to_end(sched, runner)
    assert {r: len(t) for r, t in tokens.items()} == {"short": 3, "long": 7, "full": 1}
    assert set(reasons.values()) == {FinishReason.LENGTH}
    for so, _ in steps:  # no position at or past max_model_len is ever computed
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        starts.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
        assert all(starts[rid] + n <= 12 for rid, n in so.num_scheduled_tokens.items())


def test_a_stop_token_inside_a_multi_token_output_drops_the_rest_and_leaves_the_runner_output_alone():
    sched = Scheduler(config(), eos_token_id=EOS)
    sched.add_request(make_ecr("a", prompt(10, 4), max_tokens=10))
    so = sched.schedule()
    sampled = [[7, EOS, 9]]  # as a speculative step could return
    out = sched.update_from_output(so, ModelRunnerOutput(["a"], {"a": 0}, sampled))
    assert out.outputs[0].new_token_ids == [7, EOS] and sampled == [[7, EOS, 9]]


def test_abort_frees_now_reports_once_and_emits_no_output():
    sched, runner = make(config())
    sched.add_request(make_ecr("run", prompt(10, 5), max_tokens=10))
    sched.add_request(make_ecr("wait", prompt(30, 5), max_tokens=10))
    step(sched, runner)
    sched.add_request(make_ecr("queued", prompt(50, 5), max_tokens=10))
    held = sched.kv_cache_manager.num_free_blocks
    sched.abort_requests(["run", "queued", "unknown"])
    assert sched.kv_cache_manager.num_free_blocks == held + 2 and sched.get_request_counts() == (1, 0)
    so, out = step(sched, runner)
    assert so.finished_req_ids == {"run", "queued"} and set(so.num_scheduled_tokens) == {"wait"}
    assert all(o.request_id == "wait" for o in out.outputs) and out.finished_requests == {"run", "queued"}
    so, _ = step(sched, runner)
    assert so.finished_req_ids == set()
    sched.abort_requests("wait")
    run_to_end(sched, runner)
    assert_pool_free(sched)


def test_abort_between_schedule_and_update_drops_the_sampled_token():
    sched, runner = make(config())
    sched.add_request(make_ecr("a", prompt(10, 5), max_tokens=10))
    so = sched.schedule()
    mro = runner.execute_model(so)
    sched.abort_requests(["a"])
    assert sched.update_from_output(so, mro).outputs == []


# -- outputs -----------------------------------------------------------------------------------------------------------


def test_logprobs_rows_go_to_the_requests_that_asked():
    sched = Scheduler(config(), eos_token_id=EOS)
    sched.add_request(make_ecr("a", prompt(10, 4), max_tokens=5, logprobs=1))
    sched.add_request(make_ecr("b", prompt(30, 4), max_tokens=5))
    so = sched.schedule()
    ids = np.array([[7, 7, 8], [9, 9, 3]], dtype=np.int32)
    lps = np.array([[-0.1, -0.1, -2.0], [-0.5, -0.5, -1.0]], dtype=np.float32)
    ranks = np.array([1, 1], dtype=np.int32)
    lists = LogprobsLists(Array.from_numpy(ids), Array.from_numpy(lps), Array.from_numpy(ranks))
    plp = LogprobsTensors(Array.from_numpy(ids[:1]), Array.from_numpy(lps[:1]), Array.from_numpy(ranks[:1]))
    mro = ModelRunnerOutput(["b", "a"], {"b": 0, "a": 1}, [[9], [7]], lists, {"a": plp})
    out = {o.request_id: o for o in sched.update_from_output(so, mro).outputs}
    assert out["b"].new_logprobs is None
    got = out["a"].new_logprobs
    assert got.logprob_token_ids.to_numpy().tolist() == [[9, 9, 3]]
    assert got.logprobs.to_numpy().tobytes() == lps[1:2].tobytes()
    assert got.sampled_token_ranks.to_numpy().tolist() == [1]
    assert out["a"].new_prompt_logprobs_tensors is plp


def test_a_request_asking_only_logprob_token_ids_gets_its_rows_as_vllms_num_logprobs_says():
    sched = Scheduler(config(), eos_token_id=EOS)
    sched.add_request(make_ecr("a", prompt(10, 4), max_tokens=5, logprob_token_ids=[3, 4]))
    so = sched.schedule()
    ids = np.array([[7, 3, 4]], dtype=np.int32)
    lps = np.array([[-0.1, -2.0, -3.0]], dtype=np.float32)
    lists = LogprobsLists(Array.from_numpy(ids), Array.from_numpy(lps), Array.from_numpy(np.array([1], np.int32)))
    mro = ModelRunnerOutput(["a"], {"a": 0}, [[7]], lists, {})
    (out,) = sched.update_from_output(so, mro).outputs
    assert out.new_logprobs.logprob_token_ids.to_numpy().tolist() == [[7, 3, 4]]


def test_new_request_data_mirrors_vllm():
    sched = Scheduler(config(), eos_token_id=EOS)
    sched.add_request(make_ecr("a", prompt(10, 5), max_tokens=5, temperature=0.0))
    so = sched.schedule()
    [new] = so.scheduled_new_reqs
    assert (new.req_id, new.prompt_token_ids, new.mm_features, new.pooling_params, new.lora_request) == \
        ("a", prompt(10, 5), [], None, None)
    assert new.sampling_params.temperature == 0.0 and new.block_ids == ([0, 1],)
    assert so.scheduled_spec_decode_tokens == {} and so.scheduled_encoder_inputs == {}
    assert so.free_encoder_mm_hashes == [] and so.preempted_req_ids == set()
    assert so.num_common_prefix_blocks == [2]  # a runs alone: all its blocks are common to the running set


def test_requests_the_engine_cannot_run_are_refused():
    sched = Scheduler(config(num_gpu_blocks=4, max_model_len=32), eos_token_id=EOS)
    with pytest.raises(ValueError, match="longer than max_model_len"):
        sched.add_request(make_ecr("long", prompt(0, 33)))
    with pytest.raises(ValueError, match="do not fit"):
        sched.add_request(make_ecr("big", prompt(0, 8), max_tokens=20))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_ecr("empty", []))
    sched.add_request(make_ecr("ok", prompt(0, 8), max_tokens=8))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_ecr("ok", prompt(0, 8), max_tokens=8))


def test_many_requests_with_shared_prefixes_and_a_tight_pool_all_finish():
    # a randomised soak: every step is checked by FakeRunner's KV consistency asserts
    seed = 1234
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    cfg = config(num_gpu_blocks=24, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=48)
    sched, runner = make(cfg, next_token=lambda rid, i: 3 + (i * 7 + len(rid)) % 5)
    stems = [prompt(10, 9), prompt(40, 6)]
    for i in range(20):
        p = list(stems[i % 2]) + [int(t) for t in rng.integers(100, 110, size=int(rng.integers(1, 8)))]
        sched.add_request(make_ecr(f"r{i}", p, max_tokens=int(rng.integers(1, 15)),
                                   stop_token_ids=[5] if i % 3 == 0 else None))
    _, tokens, reasons = run_to_end(sched, runner, max_steps=2000)
    assert set(reasons) == {f"r{i}" for i in range(20)}
    assert sched.make_stats().prefix_cache_stats.hits > 0
    assert_pool_free(sched)


# -- block hashing -----------------------------------------------------------------------------------------------------


def test_block_hashes_are_chained():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4)) and len(h0) == 32
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != h0


_HASH_SCRIPT = """
from replay.contracts import EngineCoreRequest, SamplingParams
from replay.engine.kv_cache_manager import update_block_hashes
from replay.engine.request import Request
ecr = EngineCoreRequest("x", list(range(10)), None, SamplingParams(), None, 0.0, None, "salt", None)
print(",".join(h.hex() for h in update_block_hashes(Request.from_engine_core_request(ecr, 2), 4)))
"""


def test_block_hashes_are_the_same_in_every_process():
    hashes = set()
    for hash_seed in ("0", "1", "random"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        res = subprocess.run([sys.executable, "-c", _HASH_SCRIPT], env=env, capture_output=True, text=True,
                             check=True)
        hashes.add(res.stdout.strip())
    assert len(hashes) == 1
    req = Request.from_engine_core_request(
        EngineCoreRequest("x", list(range(10)), None, SamplingParams(), None, 0.0, None, "salt", None), 2)
    assert hashes == {",".join(h.hex() for h in update_block_hashes(req, 4))}
    assert len(req.block_hashes) == 2  # 10 tokens: two full blocks of 4


def test_request_state_follows_its_tokens():
    req = Request.from_engine_core_request(make_ecr("a", [1, 2, 3], max_tokens=4, eos_token_id=9), EOS)
    assert req.eos_token_id == 9 and req.status == RequestStatus.WAITING and req.external_req_id == "a"
    req.append_output_token_ids(5)
    req.append_output_token_ids([6, 7])
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (6, 3, 3)
    assert req.all_token_ids == [1, 2, 3, 5, 6, 7] and req.prompt_token_ids == [1, 2, 3]
    assert not req.is_finished() and req.get_finished_reason() is None
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.is_finished() and req.get_finished_reason() == FinishReason.LENGTH
