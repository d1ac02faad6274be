"""The synthetic engine keeps vLLM's step invariants (so the capture benchmarks measure realistic frames)."""

from replay.record.synth import SynthShape, synth_events


def test_steps_follow_vllm_invariants():
    w = SynthShape(steps=60, running=8, prompt_len=(10, 40), output_len=(2, 10), max_num_batched_tokens=32, seed=5)
    arrived, live, finished_prev = set(), set(), set()
    for ev in synth_events(w):
        if ev.request is not None:
            arrived.add(ev.request.request_id)
            continue
        so, mro = ev.scheduler_output, ev.model_runner_output
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) <= w.max_num_batched_tokens
        assert set(so.num_scheduled_tokens) <= arrived
        assert not set(so.num_scheduled_tokens) & finished_prev  # finished requests are never scheduled again
        new = {r.req_id for r in so.scheduled_new_reqs}
        assert not new & live  # "new" means scheduled for the first time
        live |= new
        assert mro.req_ids == list(so.num_scheduled_tokens)
        for rid, toks in zip(mro.req_ids, mro.sampled_token_ids):
            assert len(toks) <= 1
        lp = mro.logprobs
        ids = lp.logprob_token_ids.to_numpy()
        for i, toks in enumerate(mro.sampled_token_ids):
            if toks:
                assert ids[i, 0] == toks[0]  # column 0 is the sampled token
        finished_prev |= so.finished_req_ids


def test_same_seed_same_stream():
    a = [e.model_runner_output for e in synth_events(SynthShape(steps=5, running=4, seed=1)) if e.model_runner_output]
    b = [e.model_runner_output for e in synth_events(SynthShape(steps=5, running=4, seed=1)) if e.model_runner_output]
    assert a == b
