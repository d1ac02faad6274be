"""The writer's shadow request table against the scheduler it shadows, and keyframes against the runner's KV cache.

The scheduler is our vLLM-faithful one (`replay.engine.scheduler`), driven by the test scheduler's `FakeRunner`,
whose KV cache holds the token id written at each slot and which checks, every step, that each scheduled request
reads back exactly its own context. A second `FakeRunner`, primed from a keyframe taken in the middle of the run
(the cached blocks' tokens, then the live requests', written into their blocks), then follows the same steps: a
block the keyframe forgot or filled wrongly fails its checks the first time a later request reads it.
Preemption, prefix-cache hits on blocks no live request holds, chunked prefill and aborts all happen in these runs.
The same shadow against vLLM's own `Scheduler.requests` is in tests/integrations/vllm.
"""

from __future__ import annotations

import numpy as np
import pytest

from replay.capture.format.keyframe import Keyframe
from replay.capture.format.shadow import ShadowTable
from replay.engine.request import Request
from tests.engine.test_scheduler import FakeRunner, _ReqState, config, make, make_ecr


def _primed(kf: Keyframe, block_size: int, num_blocks: int) -> FakeRunner:
    """A FakeRunner in the keyframe's state: the left-behind blocks first (oldest first), then the live requests."""
    runner = FakeRunner(block_size, num_blocks, exclusive_writes=False)

    def fill(tokens: list[int], blocks: list[int], n: int) -> None:
        for p in range(n):
            runner.kv[blocks[p // block_size]][p % block_size] = tokens[p]

    for c in kf.cached:
        fill(c.token_ids, c.block_ids[0], len(c.token_ids))
    for r in kf.requests:
        if not r.scheduled:
            continue
        fill(r.token_ids, r.block_ids[0] if r.block_ids else [], r.num_computed_tokens)
        runner.reqs[r.request.request_id] = _ReqState(r.token_ids, len(r.request.prompt_token_ids),
                                                      r.block_ids[0] if r.block_ids else [], r.num_computed_tokens,
                                                      preempted=r.preempted)
    return runner


def _check_against_scheduler(shadow: ShadowTable, sched) -> None:
    """Every live request the scheduler runs is in the shadow with its tokens, K/V count and block table."""
    kf = shadow.keyframe()
    live = {r.request.request_id: r for r in kf.requests}
    # the runner still holds what finished in the last step: the next step's finished_req_ids frees it
    assert set(sched.requests) <= set(live) <= set(sched.requests) | sched.finished_req_ids
    for rid, req in sched.requests.items():
        r: Request = req
        mine = live[rid]
        assert mine.output_token_ids == list(r.output_token_ids)
        if mine.preempted:
            assert r.status.name in ("PREEMPTED", "WAITING", "RUNNING")  # (it may be resumed in the next step)
            continue
        if r.status.name == "RUNNING":
            assert mine.num_computed_tokens == r.num_computed_tokens
            assert mine.block_ids[0] == [b.block_id for b in sched.kv_cache_manager.req_to_blocks[rid]]


@pytest.mark.parametrize("seed", range(6))
def test_a_runner_primed_from_any_keyframe_reads_back_every_context_the_run_goes_on_to_read(seed):
    rng = np.random.default_rng(seed)
    # a small pool (preemption), a small budget (chunked prefill), shared prefixes (prefix-cache hits)
    cfg = config(block_size=4, num_gpu_blocks=int(rng.integers(16, 28)),
                 max_num_batched_tokens=int(rng.integers(8, 40)),
                 max_num_seqs=6, enable_prefix_caching=True)
    sched, runner = make(cfg, exclusive_writes=False)
    shadow = ShadowTable(cfg.block_size, cfg.enable_prefix_caching)
    prefixes = [list(range(100 * k, 100 * k + int(rng.integers(4, 14)))) for k in range(3)]
    followers: list[FakeRunner] = []
    n, keyframes = 0, 0
    for index in range(160):
        for _ in range(int(rng.poisson(0.6))):
            pre = prefixes[int(rng.integers(len(prefixes)))]
            ecr = make_ecr(f"r{n}", pre + list(range(5000 + 7 * n, 5000 + 7 * n + int(rng.integers(1, 9)))),
                           max_tokens=int(rng.integers(1, 30)), ignore_eos=True)
            n += 1
            sched.add_request(ecr)
            shadow.add_request(ecr, index)
        if sched.requests and rng.random() < 0.03:
            victim = sorted(sched.requests)[int(rng.integers(len(sched.requests)))]
            sched.abort_requests([victim])
            shadow.abort_request(victim)
        if index % 9 == 4 and shadow.live:
            followers.append(_primed(shadow.keyframe(), cfg.block_size, cfg.num_gpu_blocks))
            keyframes += 1
        so = sched.schedule()
        out = runner.execute_model(so)
        for f in followers:  # each checks every read of the steps after its keyframe
            mine = f.execute_model(so)
            assert mine.sampled_token_ids == out.sampled_token_ids
        sched.update_from_output(so, out)
        shadow.step(index, so, out)
        _check_against_scheduler(shadow, sched)
    assert keyframes >= 5 and sched.make_stats().num_preemptions > 0
    assert sched.make_stats().prefix_cache_stats.hits > 0


def test_what_no_block_holds_any_more_is_forgotten():
    cfg = config(block_size=4, num_gpu_blocks=8, max_num_batched_tokens=64, enable_prefix_caching=True)
    sched, runner = make(cfg)
    shadow = ShadowTable(cfg.block_size, True)
    for i in range(40):  # one request at a time, each with its own prompt: each evicts the last one's blocks
        ecr = make_ecr(f"r{i}", list(range(1000 * i, 1000 * i + 12)), max_tokens=2, ignore_eos=True)
        sched.add_request(ecr)
        shadow.add_request(ecr, i)
        while sched.has_requests():
            so = sched.schedule()
            out = runner.execute_model(so)
            sched.update_from_output(so, out)
            shadow.step(shadow.next_step, so, out)
    kf = shadow.keyframe()
    assert not kf.requests
    held = {b for c in kf.cached for b in c.block_ids[0]}
    assert len(kf.cached) <= 3 and held <= set(range(cfg.num_gpu_blocks))
    assert len(shadow.left) == len(kf.cached)  # memory follows the pool, not the requests ever seen
