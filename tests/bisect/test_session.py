"""`co_batched`: whom a vLLM-runner bisect may leave out of every step. A request that hits another's KV blocks
through the prefix cache keeps that one (left out, nothing would write what it reads). The SchedulerOutputs here
come from our engine, which schedules prefix hits as vLLM's does (a new request's `num_computed_tokens` counts
the blocks it found computed)."""

from __future__ import annotations

import pytest

from replay.bisect.batch import bisect_batch
from replay.bisect.layers import bisect_layers
from replay.bisect.session import co_batched, not_scheduled
from replay.capture import CaptureReader, Step
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.errors import UsageError
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic


def test_a_request_keeps_the_neighbour_whose_prefix_blocks_it_reads(tmp_path):
    wl = SyntheticWorkload(num_requests=10, prompt_len=(24, 40), output_len=(6, 10), arrival_rate=1.0,
                           shared_prefix_fraction=0.6, sampling="greedy", num_logprobs=1, seed=4)
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=256, max_num_seqs=8,
                                                 enable_prefix_caching=True), runner=RunnerConfig(num_threads=1))
    path = record_builtin(RecordOptions(cfg, synthetic(wl, 512), tmp_path / "prefix.capture")).path
    owner: dict[int, str] = {}
    hitter = None
    with CaptureReader(path) as r:
        steps = [rec for rec in r.records() if isinstance(rec, Step)]
    for st in steps:
        for n in st.scheduler_output.scheduled_new_reqs:
            hits = n.num_computed_tokens // 4
            if hits and hitter is None and owner.get(n.block_ids[0][0]) not in (None, n.req_id):
                hitter, writer, at = n.req_id, owner[n.block_ids[0][0]], st.index
            for b in n.block_ids[0][hits:]:
                owner.setdefault(b, n.req_id)
    assert hitter is not None, "the workload must hit a prefix another request wrote"
    last = next(s.index for s in steps if s.index >= at and writer in s.scheduler_output.num_scheduled_tokens
                and hitter in s.scheduler_output.num_scheduled_tokens)
    free, kept = co_batched(path, last, hitter, 4)
    assert writer in kept and writer not in free
    assert set(free) | set(kept) == {x for s in steps if s.index <= last
                                     and hitter in s.scheduler_output.num_scheduled_tokens
                                     for x in s.scheduler_output.num_scheduled_tokens} - {hitter}
    free_w, kept_w = co_batched(path, last, writer, 4)  # the writer reads nobody's blocks
    assert hitter in free_w and not kept_w


def test_a_compiled_recording_is_bisected_eager_and_says_so():
    from replay.bisect.vllm_session import eager
    from replay.capture import EngineConfig

    compiled = EngineConfig(layout={"enforce_eager": "False", "compilation_mode": "VLLM_COMPILE"})
    knobs, notes = eager(compiled, {"runner": "vllm"})
    assert knobs == {"runner": "vllm", "enforce_eager": "true"} and "run eager here" in notes[0]
    assert eager(EngineConfig(layout={"enforce_eager": "True"}), {"runner": "vllm"}) == ({"runner": "vllm"}, [])
    assert eager(EngineConfig(layout={"enforce_eager": "True"}), {"enforce_eager": "false"})[1]  # a knob compiles


def test_each_kv_cache_group_has_block_ids_of_its_own(tmp_path):
    """A hybrid model's groups number their blocks apart: b hits block 10 of group 1, which a wrote; c wrote block
    10 of group 0, which b never reads, so c can be left out."""
    import msgspec

    from replay.bisect.session import kv_readers
    from replay.capture import FORMAT_MAJOR, FORMAT_MINOR, CaptureWriter, Header
    from replay.contracts import NewRequestData, SamplingParams, SchedulerOutput

    def new(rid: str, groups: tuple[list[int], ...], computed: int, length: int = 8) -> NewRequestData:
        return NewRequestData(rid, list(range(length)), [], SamplingParams(temperature=0.0), None, groups, computed,
                              None)

    def step(i: int, *reqs: NewRequestData, also: tuple[str, ...] = ()) -> Step:
        sched = {n.req_id: len(n.prompt_token_ids) - n.num_computed_tokens for n in reqs} | dict.fromkeys(also, 1)
        so = msgspec.structs.replace(SchedulerOutput.make_empty(), scheduled_new_reqs=list(reqs),
                                     num_scheduled_tokens=sched, total_num_scheduled_tokens=sum(sched.values()))
        return Step(i, so, None)

    path = tmp_path / "hybrid.capture"
    w = CaptureWriter(path, Header((FORMAT_MAJOR, FORMAT_MINOR), "test", 0.0, "synthetic"), keyframes=0)
    w.write_record(step(0, new("a", ([0, 1], [10, 11]), 0)))
    w.write_record(step(1, new("c", ([10, 12], [20, 21]), 0)))
    w.write_record(step(2, new("b", ([0, 30], [10, 31]), 4), also=("a", "c")))  # one whole block found computed
    w.close()
    assert kv_readers(path, 2, "b", 4) == (["c"], ["a"], {"a": 4})
    assert kv_readers(path, 2, "c", 4) == (["b", "a"], [], {})  # c reads nobody's blocks

    whole = tmp_path / "whole.capture"  # b reads every token a has: nothing of a's is left to swap
    w = CaptureWriter(whole, Header((FORMAT_MAJOR, FORMAT_MINOR), "test", 0.0, "synthetic"), keyframes=0)
    w.write_record(step(0, new("a", ([0], [10]), 0, length=4)))
    w.write_record(step(1, new("b", ([0, 30], [10, 31]), 4), also=("a",)))
    w.close()
    assert kv_readers(whole, 1, "b", 4) == ([], ["a"], {})


def test_a_bisect_from_python_checks_its_knobs_and_runner(tmp_path):
    """What a script hands a bisect is checked as `--set` and `--runner` are, before any replay."""
    wl = SyntheticWorkload(num_requests=3, prompt_len=(4, 6), output_len=(3, 4), arrival_rate=0, seed=1)
    path = record_builtin(RecordOptions(EngineConfig(), synthetic(wl, 512), tmp_path / "a.capture")).path
    with pytest.raises(UsageError, match="unknown knob 'nonsense'"):
        bisect_batch(path, 2, "req-0", overrides={"nonsense": "1"})
    for bisect in (bisect_layers, bisect_batch):
        with pytest.raises(UsageError, match="runner 'bogus': expected builtin or vllm"):
            bisect(path, 2, "req-0", runner="bogus")


def test_a_request_named_by_an_openai_responses_id_is_pointed_at_its_prompts_requests():
    """The response says `cmpl-ab`; the engine's requests are `cmpl-ab-0`, `cmpl-ab-1` (one per prompt)."""
    said = str(not_scheduled("cmpl-ab", 4, ["cmpl-ab-0", "cmpl-cd-0", "cmpl-ab-1"]))
    assert said.startswith("request 'cmpl-ab' is not scheduled in step 4 (scheduled: cmpl-ab-0, cmpl-cd-0, cmpl-ab-1)")
    assert said.endswith("requests cmpl-ab-0, cmpl-ab-1, ...: cmpl-ab-0, cmpl-ab-1 here")
    assert "OpenAI" not in str(not_scheduled("x", 4, ["y-0"]))


def test_an_openai_responses_id_names_its_one_prompts_request(tmp_path):
    """A server's response of one prompt says `cmpl-ab`, its engine's request is `cmpl-ab-0`: the bisects and
    `explain --pair` take either. A response of two prompts names two requests, and is still pointed at them."""
    from replay.bisect.explain_pair import explain_pair
    from replay.contracts import SamplingParams
    from replay.record import WorkloadRequest

    twin = list(range(50, 70))
    reqs = [WorkloadRequest(SamplingParams(max_tokens=6, logprobs=3, temperature=0.0), None, prompt, name, 0)
            for name, prompt in (("cmpl-ab-0", twin), ("cmpl-cd-0", twin), ("cmpl-ef-0", list(range(100, 112))),
                                 ("cmpl-ef-1", list(range(200, 216))))]
    cfg = EngineConfig(scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=100, max_num_seqs=8),
                       runner=RunnerConfig(num_threads=1))
    path = record_builtin(RecordOptions(cfg, reqs, tmp_path / "server.capture")).path
    bare, full = bisect_batch(path, 2, "cmpl-ab"), bisect_batch(path, 2, "cmpl-ab-0")
    assert (bare.request, bare.minimal_set, bare.verdict) == (full.request, full.minimal_set, full.verdict)
    assert bisect_layers(path, 2, "cmpl-ab", "solo").request == bisect_layers(path, 2, "cmpl-ab-0", "solo").request
    res = explain_pair(path, "cmpl-ab", "cmpl-cd")
    assert (res.a, res.b) == ("cmpl-ab-0", "cmpl-cd-0"), res
    with pytest.raises(UsageError, match="names its prompts' requests cmpl-ef-0, cmpl-ef-1"):
        bisect_batch(path, 2, "cmpl-ef")
    # `explain --step S --request` and `show --request` too (they find the request as they read the steps)
    from replay.bisect.explain_divergence import NOTHING, explain_divergence
    from replay.inspect import show_steps

    res = explain_divergence(path, step=2, request="cmpl-ab")
    assert res.found == NOTHING and "at step 2 for request cmpl-ab-0 matches" in res.verdict, res.verdict
    assert show_steps(path, request="cmpl-ab").request == show_steps(path, request="cmpl-ab-0").request
    with pytest.raises(UsageError, match="'cmpl-ef' is an OpenAI response with 2 prompts; name one of its requests: "
                                         "cmpl-ef-0, cmpl-ef-1"):
        explain_divergence(path, step=2, request="cmpl-ef")
