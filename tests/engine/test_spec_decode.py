"""Draft verification (speculative decoding) on the builtin runner, against its own one-token-per-step decode: drafts
equal to the greedy continuation are all accepted and give the same tokens and logprobs in one step; a wrong draft
is rejected at its position with the target's token in its place. The rejection rule itself on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from replay.contracts import SamplingParams, SchedulerOutput
from replay.engine.model_runner import ModelRunner
from replay.engine.sampler import SampleRow
from replay.engine.spec_decode import verify_drafts
from replay.engine.weights import tiny_model
from replay.provenance import set_torch_threads
from tests.engine.test_model_runner import BS, cached, new, so

PROMPT = list(range(3, 14))
BLOCKS = [5, 9, 2, 7, 11, 12]  # room for the prompt and 12 more tokens


@pytest.fixture(scope="module")
def model():
    set_torch_threads(1)
    m, _, _ = tiny_model()
    return m


def _prefill(model) -> tuple[ModelRunner, list[int]]:
    r = ModelRunner(model, num_blocks=32, block_size=BS)
    out = r.execute_model(so([new("a", PROMPT, BLOCKS)], sched={"a": len(PROMPT)}))
    return r, out.sampled_token_ids[0]


def _sequential(model, steps: int):
    """Greedy decode one token per step: the tokens, and each token's logprob row (ids, values)."""
    r, first = _prefill(model)
    toks, rows = list(first), []
    for _ in range(steps):
        n = len(PROMPT) + len(toks) - 1
        out = r.execute_model(so(cached=cached(["a"], [n], outputs=[len(toks)]), sched={"a": 1}))
        toks += out.sampled_token_ids[0]
        rows.append((out.logprobs.logprob_token_ids.to_numpy()[0], out.logprobs.logprobs.to_numpy()[0]))
    return toks, rows


def _verify_step(model, drafts: list[int]):
    r, first = _prefill(model)
    step = SchedulerOutput([], cached(["a"], [len(PROMPT)], outputs=[1]), {"a": 1 + len(drafts)}, 1 + len(drafts),
                           {"a": drafts}, {}, set(), [])
    return first, r.execute_model(step), r


def test_drafts_equal_to_the_greedy_continuation_are_all_accepted_with_the_same_tokens_and_logprobs(model):
    ref, rows = _sequential(model, 4)
    first, out, r = _verify_step(model, ref[1:4])
    assert first == ref[:1]
    assert out.sampled_token_ids == [ref[1:5]]  # 3 drafts accepted + the bonus token
    assert out.logprobs.cu_num_generated_tokens == [0, 4]
    for k in range(4):
        ids, vals = out.logprobs.logprob_token_ids.to_numpy()[k], out.logprobs.logprobs.to_numpy()[k]
        assert (ids == rows[k][0]).all() and abs(vals - rows[k][1]).max() < 1e-5
    assert r.requests["a"].output_token_ids == ref[:5]


def test_a_wrong_draft_is_rejected_at_its_position_and_the_target_token_takes_its_place(model):
    ref, _ = _sequential(model, 4)
    wrong = (ref[2] + 1) % 500
    _, out, r = _verify_step(model, [ref[1], wrong, ref[3]])
    assert out.sampled_token_ids == [ref[1:3]]  # draft 0 accepted, draft 1 rejected: the target's token instead
    assert out.logprobs.cu_num_generated_tokens == [0, 2]
    assert r.requests["a"].output_token_ids == ref[:3]


def test_the_rejection_rule_on_hand_made_logits():
    """Greedy: accept while the argmax equals the draft. Random: draft d accepted with probability P(d) (a draft
    without draft probabilities counts as certain, as vLLM's ngram path does); on rejection the token is drawn
    from P with d removed. A request that is not drawing (partial prefill) emits nothing but keeps its row."""
    v = 8
    logits = torch.full((7, v), -10.0)
    logits[0, 3] = logits[1, 4] = logits[2, 5] = 5.0  # greedy request: argmaxes 3, 4, 5
    logits[3, 1] = 0.0  # random request, one draft: P(draft 1) ~ 1 at position 0 -> accepted; then the bonus
    logits[4, 6] = 0.0
    logits[5, 2] = 0.0  # random request whose draft 7 has P ~ 0: rejected, the recovered token is 2
    logits[6, 0] = 0.0  # a partial prefill chunk (not drawing)
    greedy = SampleRow(SamplingParams(temperature=0.0, logprobs=2), None, [1], [], ())
    rnd = SampleRow(SamplingParams(temperature=1.0, logprobs=2), torch.Generator().manual_seed(0), [1], [], ())
    rnd2 = SampleRow(SamplingParams(temperature=1.0, logprobs=2), torch.Generator().manual_seed(1), [1], [], ())
    partial = SampleRow(SamplingParams(temperature=0.0, logprobs=2), None, [1], [], (), draw=False)
    sampled, lp = verify_drafts(logits, [greedy, rnd, rnd2, partial], [[3, 9], [1], [], []], 2)
    assert sampled[0] == [3, 4]  # draft 3 accepted, draft 9 rejected: the argmax 4 instead
    assert sampled[1] == [1, 6]  # draft 1 accepted, bonus 6
    assert sampled[2] == [2] and sampled[3] == []
    assert lp.cu_num_generated_tokens == [0, 2, 4, 5, 6]
    assert lp.logprob_token_ids.to_numpy()[:, 0].tolist() == [3, 4, 1, 6, 2, 0]
    sampled, none = verify_drafts(logits[5:6].expand(2, v).clone(), [rnd2], [[7]], -1)
    assert sampled == [[2]] and none is None  # P(7) ~ 0: rejected, recovered from P without it; no logprobs asked
