"""A builtin-engine capture with twins: two greedy requests with one prompt, in batches of other shapes (the case
`replay explain --pair` answers)."""

from __future__ import annotations

from pathlib import Path


def record_twins(path: Path, *, prefix_caching: bool = False, max_tokens: int = 10,
                 batch_invariant: bool = False, b_at: int = 30, a_first: bool = False,
                 twin_len: int = 20, d_beside_a: bool = False, b_params: dict | None = None) -> Path:
    """Greedy twins `a` and `b` (one `twin_len`-token prompt, 3 logprobs): `a` the sixth request of a batch of six
    prefills at step 0, after n0..n4 (with `a_first`, before them: the row a planted leak reads, never one it writes
    into); `b` arriving once they are done (at step `b_at`: earlier, beside them), beside `c` (the same prompt,
    sampled with a seed: no twin of theirs). One thread, blocks of 4 tokens; with `prefix_caching`, `b` finds its
    full blocks cached but for one holding its last token (16 of 20 tokens; 20 of 21, and then it prefills one);
    `batch_invariant`: recorded in batch-invariant mode; `d_beside_a`: a third twin `d` in `a`'s batch, after it;
    `b_params`: `b`'s sampling parameters that differ from `a`'s (how many tokens, logprobs)."""
    from replay.contracts import SamplingParams
    from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
    from replay.record import RecordOptions, WorkloadRequest, record_builtin

    def request(name: str, prompt: list[int], at: int, **sp) -> WorkloadRequest:
        params = SamplingParams(**{"max_tokens": max_tokens, "logprobs": 3, "temperature": 0.0, **sp})
        return WorkloadRequest(params, None, prompt, name, at)

    twin = list(range(50, 50 + twin_len))
    first = [request(f"n{i}", list(range(100 + 20 * i, 112 + 20 * i)), 0) for i in range(5)] + [request("a", twin, 0)]
    first += [request("d", twin, 0)] if d_beside_a else []
    reqs = [*(first[-1:] + first[:-1] if a_first else first), request("b", twin, b_at, **(b_params or {})),
            request("c", twin, b_at, temperature=0.8, seed=1)]
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=200, max_num_seqs=8,
                                                 max_num_batched_tokens=128, enable_prefix_caching=prefix_caching),
                       runner=RunnerConfig(num_threads=1, batch_invariant=batch_invariant))
    record_builtin(RecordOptions(cfg, reqs, path))
    return path
