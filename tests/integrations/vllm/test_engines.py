"""One started vLLM engine serves many replays (`replay.integrations.vllm.engines`): a corpus of one layout starts
one engine, and a replay on a reused engine is the replay on a fresh one, bit for bit, the draws of unseeded
requests included (the engine's generators go back to where they stood when it started)."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from replay.bisect.batch import bisect_batch  # noqa: E402
from replay.bisect.layers import bisect_layers  # noqa: E402
from replay.bisect.leak import bisect_leak  # noqa: E402
from replay.capture import CaptureReader  # noqa: E402
from replay.errors import CannotTestError, CaptureDamagedError, UsageError  # noqa: E402
from replay.integrations.vllm.engines import Engines  # noqa: E402
from replay.processes.fanout import FanOut  # noqa: E402
from replay.replayer import ReplayOptions, replay_capture  # noqa: E402
from replay.replayer.corpus import check_corpus  # noqa: E402
from testbed.checkpoints import tiny_llama  # noqa: E402
from tests.vllm_captures import record  # noqa: E402

VLLM = {"runner": "vllm"}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Greedy, seeded and unseeded requests in one batch, on vLLM's offline engine."""
    d = tmp_path_factory.mktemp("engines")
    return record(tiny_llama(d / "tiny-llama"), d / "mixed.capture", seeded=True, unseeded=True, max_tokens=8)


@pytest.fixture(scope="module")
def pool():
    """One pool for the tests that need an engine of `mixed`'s layout held, not a start of their own (~10 s each)."""
    with Engines() as engines:
        yield engines


def test_replays_on_a_reused_engine_are_the_replay_on_a_fresh_one(mixed):
    fresh = replay_capture(mixed, ReplayOptions(overrides=VLLM))
    assert not fresh.diverged and fresh.foreign_draws_differ == 0
    with Engines() as engines:
        runs = [replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=engines)) for _ in range(3)]
        res = bisect_batch(mixed, 3, "2", overrides=VLLM, engines=engines)  # a bisect on the same engine
        again = replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=engines))
        assert engines.starts == 1
    for rep in [*runs, again]:
        assert not rep.diverged and rep.tokens_compared == fresh.tokens_compared, rep.first_divergence
    assert res.step == 3 and res.re_executions > 2


def test_captures_that_differ_in_the_engine_seed_share_one_engine(mixed, pool, tmp_path):
    """RL workers record with a seed each: their captures replay on one engine, reseeded between them, and each
    replay is bitwise, the unseeded requests' draws (which the seed decides) included."""
    seven = record(mixed.parent / "tiny-llama", tmp_path / "seed7.capture", seeded=True, unseeded=True,
                   max_tokens=8, engine_args={"seed": 7})
    unseeded = [_tokens(c, "2") for c in (mixed, seven)]
    assert unseeded[0] != unseeded[1]  # the seed decided the unseeded request's tokens
    before = pool.starts
    reps = [replay_capture(c, ReplayOptions(overrides=VLLM, engines=pool)) for c in (mixed, seven, mixed)]
    reps.append(replay_capture(seven, ReplayOptions(overrides={**VLLM, "vllm.seed": "7.0"}, engines=pool)))
    assert pool.starts - before <= 1  # (none where the pool held the layout's engine already)
    started = pool.starts
    [engine] = pool.held()
    engine.reseedable = False  # as an engine whose warm-up drew after vLLM reseeded it would be: not reused
    reps.append(replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=pool)))
    assert pool.starts == started + 1 and engine not in pool.held()
    for rep in reps:
        assert not rep.diverged and rep.foreign_draws_differ == 0 and rep.tokens_compared > 0, rep.first_divergence
        assert not rep.environment_differences, rep.environment_differences  # it says the recording's seed


def _tokens(capture, request: str) -> list[int]:
    """Every token request `request` (the offline engine's index: internal ids are `{index}-{random}`) sampled in
    `capture`."""
    with CaptureReader(capture) as reader:
        return [t for step in reader.steps() if step.model_runner_output is not None
                for rid, toks in zip(step.model_runner_output.req_ids, step.model_runner_output.sampled_token_ids)
                if rid.split("-")[0] == request for t in toks]


def test_a_capture_with_no_readable_step_starts_no_engine(mixed, tmp_path):
    """A server killed inside its first chunk: the replay is refused as damaged before vLLM starts for nothing."""
    with CaptureReader(mixed) as reader:
        chunk = next(c for c in reader.index.chunks if c.num_steps)
    cut = tmp_path / "cut.capture.partial"
    cut.write_bytes(mixed.read_bytes()[:chunk.offset + chunk.length // 2])
    with Engines() as engines:
        with pytest.raises(CaptureDamagedError, match="no readable prefix of steps"):
            replay_capture(cut, ReplayOptions(overrides=VLLM, engines=engines))
        assert engines.starts == 0


def test_arguments_vllm_refuses_leave_the_engines_held_as_they_were(mixed, pool):
    """A typo in a knob's value is refused by vLLM's configuration, which no engine held has a say in: the pool keeps
    its engines (a real model's takes minutes to start again). A closed pool starts no engine."""
    assert not replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=pool)).diverged
    held, starts = pool.held(), pool.starts
    for knob in ({"dtype": "float16", "vllm.kv_cache_dtype": "bogus"}, {"vllm.max_logprobs": "-7"}):
        with pytest.raises(UsageError, match="vLLM cannot build an engine for this capture"):
            replay_capture(mixed, ReplayOptions(overrides={**VLLM, **knob}, engines=pool))
        assert pool.held() == held
    assert not replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=pool)).diverged
    assert pool.starts == starts
    closed = Engines()
    closed.close()
    with pytest.raises(UsageError, match="this Engines pool is closed"):
        replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=closed))


def test_a_bisect_of_a_step_or_request_the_capture_lacks_starts_no_engine(mixed, pool):
    """Refused before vLLM starts, not after it and a replay to the step (seconds on a tiny model, minutes on a real
    one); the request is named by its engine's internal id, or by the one a client saw."""
    internal = next(rid for rid in _scheduled(mixed, 3) if rid.startswith("2-"))
    starts = pool.starts
    with Engines() as none:  # (an empty pool: a start would show)
        with pytest.raises(UsageError, match="no step 999 in this capture"):
            bisect_batch(mixed, 999, "2", overrides=VLLM, engines=none)
        with pytest.raises(UsageError, match="request 'nope' is not scheduled in step 3"):
            bisect_leak(mixed, 3, "nope", overrides=VLLM, engines=none)
        with pytest.raises(UsageError, match="request 'nope' is not scheduled in step 3"):
            bisect_layers(mixed, 3, "nope", overrides=VLLM, engines=none)
        assert none.starts == 0
    assert bisect_layers(mixed, 3, internal, overrides=VLLM, engines=pool).request == internal
    assert pool.starts - starts <= 1


def _scheduled(capture, step: int) -> list[str]:
    with CaptureReader(capture) as reader:
        return list(reader.step(step).scheduler_output.num_scheduled_tokens)


def test_a_corpus_of_one_layout_starts_one_engine(mixed, pool, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        shutil.copy(mixed, corpus / f"run-{i}.capture")
    res = check_corpus(corpus, ReplayOptions(overrides=VLLM))
    assert res.good == 3 and res.bad == 0 and res.engine_starts == 1, res
    assert [r.engine_starts for r in res.rows] == [1, 0, 0]
    assert not replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=pool)).diverged
    held = pool.held()  # a script's pool: the corpus takes its engine, and leaves it open
    res = check_corpus(corpus, ReplayOptions(overrides=VLLM, engines=pool))
    assert res.good == 3 and res.engine_starts == 0 and pool.held() == held and not pool.closed, res


def test_an_engine_shut_down_beside_a_held_one_leaves_the_pool_replaying(mixed, pool, tmp_path):
    """An engine of this process that the pool does not hold, shut down while the pool holds one: a recording from
    Python (`replay record --engine vllm`), a replay given no pool. Its teardown takes the process's parallel state
    with it, so the pool starts that layout afresh rather than hand out an engine that cannot step ("pipeline model
    parallel group is not initialized")."""
    from replay.contracts import SamplingParams
    from replay.record import WorkloadRequest
    from replay.record.options import EngineOptions
    from replay.record.vllm import record_vllm, vllm_record_options

    request = WorkloadRequest(SamplingParams(temperature=0.0, max_tokens=4), None, [5, 17, 200, 3])
    engine = EngineOptions("vllm", str(mixed.parent / "tiny-llama"), max_model_len=256, block_size=32)
    first = replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=pool))
    for beside in (lambda: record_vllm(vllm_record_options(engine, [request], tmp_path / "beside.capture")),
                   lambda: replay_capture(mixed, ReplayOptions(overrides=VLLM))):
        assert pool.held()
        beside()
        before = pool.starts
        again = replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=pool))
        assert not again.diverged and again.tokens_compared == first.tokens_compared, again.first_divergence
        assert pool.starts == before + 1


def test_each_local_worker_keeps_its_engine_for_the_captures_it_checks(mixed, tmp_path):
    """`check --jobs 2`: an engine per worker, not per capture (three captures, two workers: at most two starts)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        shutil.copy(mixed, corpus / f"run-{i}.capture")
    res = check_corpus(corpus, ReplayOptions(overrides=VLLM), how=FanOut(jobs=2))
    assert res.good == 3 and res.how == "2 local processes", res
    assert 1 <= res.engine_starts <= 2 and sorted(r.engine_starts for r in res.rows)[0] == 0, res.rows


def test_an_engine_that_stops_stepping_is_not_handed_out_again(mixed):
    """An engine of the pool dies (here its core is shut down behind the pool's back, as a worker lost would leave
    it): the replay on it fails, and the next replay of that layout runs on a fresh engine rather than on the dead
    one. (An engine that raised in a step and still steps, as after a reproduced crash, stays: test_plugin's corpus.)"""
    with Engines() as engines:
        assert not replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=engines)).diverged
        [dead] = engines.held()
        dead.llm.llm_engine.engine_core.shutdown()
        with pytest.raises(Exception):  # noqa: B017 - whatever vLLM raises for a step on a shut-down engine
            replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=engines))
        rep = replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=engines))
        assert not rep.diverged and rep.tokens_compared > 0 and engines.starts == 2
        assert dead not in engines.held()


def _fail_every_forward(worker) -> None:
    """In a worker: the model's forward raises from now on, while the engine still takes steps with no forward."""
    def boom(*_):
        raise RuntimeError("planted: this worker's forward fails")

    worker.model_runner.model.register_forward_pre_hook(boom)


def test_an_engine_whose_forward_fails_is_not_handed_out_again(mixed):
    """The engine still steps (an empty step returns before any forward) but its model fails: the probe at close
    runs a forward, so the pool drops it, and the next replay of that layout runs on a fresh engine."""
    with Engines() as engines:
        assert not replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=engines)).diverged
        [broken] = engines.held()
        broken.llm.collective_rpc(_fail_every_forward)
        with pytest.raises(CannotTestError, match="vLLM's runner raised at step 0, where the recording did not: "
                                                  "RuntimeError: planted"):  # (exit 125: vLLM's failure, not ours)
            replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=engines))
        assert broken not in engines.held()
        rep = replay_capture(mixed, ReplayOptions(overrides=VLLM, engines=engines))
        assert not rep.diverged and rep.tokens_compared > 0 and engines.starts == 2
