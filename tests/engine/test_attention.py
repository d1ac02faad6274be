"""Paged attention: `batched` (one call per group of short requests) equals `sdpa` (one call per request) on mixed
batches — decodes, prefills, chunks after cached context, prefix-cache hits, draft verification, sliding window,
grouped-query heads — and `reference` (float64 softmax); the batch-invariant mode is the same whatever the
implementation; a recording made with the default (`batched`) replays bitwise."""

from __future__ import annotations

import random

import pytest
import torch

from replay.capture import CaptureReader
from replay.engine import attention
from replay.engine.attention import KVCache, PagedAttention, SeqSpan
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic
from replay.replayer import ReplayOptions, replay_capture

BS = 4  # block size: small, so contexts span many blocks in a scattered order
D = 16


def make_spans(kv: KVCache, layout: list[tuple[int, int]], rnd: random.Random,
               shared: int = 0) -> list[SeqSpan]:
    """Spans for requests given as (num_computed, num_scheduled), with scattered block tables; the first `shared`
    blocks of every table are one request's (a prefix-cache hit reads blocks another request wrote)."""
    free = list(range(1, kv.num_blocks))  # block 0 stays unused: batched pads contexts with slot 0
    rnd.shuffle(free)
    prefix = [free.pop() for _ in range(shared)]
    spans, start = [], 0
    for computed, n in layout:
        need = -(-(computed + n) // BS)
        own = max(0, need - shared) if computed >= shared * BS else need
        table = (prefix[:need] if computed >= shared * BS else []) + [free.pop() for _ in range(own)]
        context = kv.slots(table[:need], 0, computed + n, "cpu")
        spans.append(SeqSpan(start, start + n, computed, context[computed:], context))
        start += n
    return spans


def run(impl: str, layout, hq: int, hkv: int, window: int | None, seed: int, shared: int = 0,
        per_token: bool = False) -> torch.Tensor:
    """One layer's attention over `layout` with random cache contents and q/k/v drawn from `seed`."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(1, 1024, BS, hkv, D, torch.float32, "cpu")
    kv.ensure(1023)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    spans = make_spans(kv, layout, rnd, shared)
    n = spans[-1].end
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (hq, hkv, hkv))
    with torch.inference_mode():
        return PagedAttention(kv, spans, impl, window, per_token=per_token).attend(0, q, k, v)


# (num_computed, num_scheduled) per request, in batch order
MIXED = [
    (40, 1), (7, 1), (0, 9),  # decodes at two context lengths, a short whole prefill
    (30, 7),  # a chunk after cached context (chunked prefill)
    (0, 3 * attention.SHORT),  # a long prefill: attends alone
    (61, 4),  # draft verification: 1 + 3 drafts
    (99, 1), (16, 20),  # a decode past 100 positions, a long chunk after cached context
    (3, 1), (12, 2),  # a one-draft verification
]


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4), (6, 2)])
@pytest.mark.parametrize("window", [None, 8, 33])
def test_batched_equals_per_request_sdpa_on_a_mixed_batch(hq, hkv, window):
    for seed in range(3):
        print("seed", seed)
        got = run("batched", MIXED, hq, hkv, window, seed)
        want = run("sdpa", MIXED, hq, hkv, window, seed)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got, run("reference", MIXED, hq, hkv, window, seed), atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", [
    [(256, 1)] * 5 + [(17, 1)],  # decode only: one group, every token in order
    [(5, 3), (0, 2), (40, 6)],  # short multi-token requests only
    [(0, 40)],  # one long prefill
    [(600, 1), (3, 1), (550, 5)],  # contexts past the fused kernel's 512-key blocks, with a window
    [(700, 1), (650, 1), (300, 1), (290, 1), (20, 1), (9, 1), (300, 3), (280, 4), (500, 2), (260, 2)],  # 5 groups
])
def test_batched_equals_sdpa_on_decode_only_and_single_kind_batches(layout):
    for window in (None, 100):
        got = run("batched", layout, 4, 2, window, 7)
        torch.testing.assert_close(got, run("sdpa", layout, 4, 2, window, 7), atol=1e-5, rtol=0)


def test_prefix_cache_hits_read_the_shared_blocks_the_same_way():
    layout = [(8, 3), (8, 1), (12, 5), (0, 30)]  # the first two blocks (8 positions) are one request's
    got = run("batched", layout, 4, 2, None, 3, shared=2)
    torch.testing.assert_close(got, run("sdpa", layout, 4, 2, None, 3, shared=2), atol=1e-5, rtol=0)


def test_long_requests_and_a_lone_short_one_attend_alone_exactly_as_sdpa():
    long = attention.SHORT + 1
    for layout in ([(0, long), (9, 2 * long)], [(0, long), (30, 1)], [(900, 1), (5, 1)]):
        assert torch.equal(run("batched", layout, 4, 2, 16, 1), run("sdpa", layout, 4, 2, 16, 1)), layout


def test_groups_bound_the_padding():
    rnd = random.Random(4)
    print("seed 4")
    for _ in range(50):
        short = []
        for _ in range(rnd.randint(1, 40)):
            n, computed = rnd.choice([1, 1, 1, 2, 3, 4, 5, 8, 9, attention.SHORT]), rnd.randint(0, 2000)
            short.append(SeqSpan(0, n, computed, torch.zeros(n), torch.zeros(computed + n)))
        groups = PagedAttention._plan(short)
        assert sorted(id(s) for g in groups for s in g) == sorted(id(s) for s in short)
        for g in groups:
            nmax, lmax = max(s.end - s.start for s in g), max(len(s.context_slots) for s in g)
            for s in g:
                assert nmax < 2 * (s.end - s.start) or nmax == 1  # the same power-of-two bracket of queries
                assert lmax <= max(attention.PAD_RATIO * len(s.context_slots), attention.MIN_KEYS)


def test_batch_invariant_mode_attends_per_token_whatever_the_implementation():
    for window in (None, 8):
        assert torch.equal(run("batched", MIXED, 4, 2, window, 5, per_token=True),
                           run("sdpa", MIXED, 4, 2, window, 5, per_token=True))


def test_batched_is_the_default_for_new_recordings():
    assert RunnerConfig().attention_impl == "batched"


def test_a_recording_with_batched_attention_replays_bitwise(tmp_path):
    # chunked prefill beside decodes, prefix hits, and decode steps of many requests
    wl = SyntheticWorkload(num_requests=10, prompt_len=(4, 40), output_len=(4, 12), arrival_rate=2,
                           shared_prefix_fraction=0.4, sampling="mixed", num_logprobs=2, seed=3)
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=80, max_num_seqs=8,
                                                 max_num_batched_tokens=24), runner=RunnerConfig(num_threads=1))
    path = tmp_path / "batched.capture"
    record_builtin(RecordOptions(cfg, synthetic(wl, 512), path))
    with CaptureReader(path) as r:
        assert r.header.engine_config.attention_impl == "batched"
    rep = replay_capture(path, ReplayOptions())
    assert not rep.diverged, rep.first_divergence
    per_request = replay_capture(path, ReplayOptions(overrides={"attention": "sdpa"}))
    assert per_request.environment_differences == ["attention: recorded batched, replay sdpa"]
