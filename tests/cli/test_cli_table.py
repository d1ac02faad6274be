"""Every command with missing, wrong-typed, out-of-range and contradictory arguments, unreadable paths and
symlink loops: exit 2 and exactly one line on stderr, never a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from replay.cli import main


@pytest.fixture
def paths(tmp_path, small_capture):
    loop_a, loop_b = tmp_path / "loop_a", tmp_path / "loop_b"
    os.symlink(loop_b, loop_a)
    os.symlink(loop_a, loop_b)
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": 5}\n')
    grammar = tmp_path / "grammar.jsonl"
    grammar.write_text('{"prompt_token_ids": [5, 6], "structured_outputs": {"regex": "[0-9]+"}}\n')
    fanout = tmp_path / "fanout.jsonl"  # what only vLLM's front end does
    fanout.write_text('{"prompt_token_ids": [5, 6], "n": 2, "stop": ["x"]}\n')
    golden = Path(__file__).resolve().parents[2] / "captures" / "tiny-mixed.capture"
    empty = tmp_path / "no-captures"
    empty.mkdir()
    return {"cap": str(small_capture), "golden": str(golden), "dir": str(tmp_path), "loop": str(loop_a),
            "missing": str(tmp_path / "nope"),
            "jsonl": str(bad_jsonl), "grammar": str(grammar), "fanout": str(fanout),
            "out": str(tmp_path / "out.capture"),
            "emptydir": str(empty)}


CASES = [
    # command line problems
    ("info",), ("show",), ("recover",), ("export",), ("run",), ("diff", "{cap}"), ("synth",),
    ("info", "{cap}", "--bogus"), ("show", "{cap}", "--step", "x"), ("show", "{cap}", "--step", "9-3"),
    ("show", "{cap}", "--limit", "0"), ("show", "{cap}", "--limit", "many"), ("export", "{cap}", "--format", "xml"),
    ("synth", "{out}", "--steps", "0"), ("synth", "{out}", "--running", "-3"), ("synth", "{cap}"),
    ("record", "--num-requests", "0"), ("record", "--prompt-len", "a:b", "--out", "{out}"),
    ("record", "--prompt-len", "9:3", "--out", "{out}"), ("record", "--dtype", "float8", "--out", "{out}"),
    ("record", "--attention", "magic", "--out", "{out}"), ("record", "--prompts", "{missing}", "--out", "{out}"),
    ("record", "--prompts", "{jsonl}", "--out", "{out}"), ("record", "--top-p", "2", "--out", "{out}"),
    ("record", "--model", "{missing}", "--out", "{out}"), ("record", "--model", "{dir}", "--out", "{out}"),
    ("record", "--engine", "sglang", "--out", "{out}"), ("record", "--engine", "vllm", "--out", "{out}"),
    ("record", "--engine", "vllm", "--attention", "sdpa", "--prompts", "{grammar}", "--model", "{dir}"),
    ("record", "--prompts", "{grammar}", "--out", "{out}"), ("record", "--prompts", "{fanout}", "--out", "{out}"),
    ("run", "{cap}", "--repeat", "0"), ("run", "{cap}", "--atol", "-1"), ("run", "{cap}", "--mode", "sideways"),
    ("run", "{cap}", "--set", "nonsense"), ("recover", "{cap}", "-o", "{cap}"),
    # unreadable inputs
    ("info", "{missing}"), ("info", "{emptydir}"), ("info", "{loop}"), ("show", "{loop}", "--step", "1"),
    ("export", "{loop}"), ("recover", "{loop}"), ("run", "{loop}", "--diff"), ("run", "{cap}", "--diff"),
    ("diff", "{loop}", "{cap}"), ("diff", "{cap}", "{missing}"),
    # knobs a replay cannot take, and selections with nothing in them
    ("run", "{golden}", "--set", "threads=0"), ("run", "{golden}", "--set", "threads=-1"),
    ("run", "{golden}", "--set", "seed=abc"), ("run", "{golden}", "--set", "device=cuda:7"),
    ("run", "{golden}", "--set", "device=tpu"), ("run", "{golden}", "--set", "dtype=float8"),
    ("run", "{golden}", "--set", "attention=magic"), ("run", "{golden}", "--set", "batch_invariant=maybe"),
    ("run", "{golden}", "--set", "model={missing}"), ("run", "{golden}", "--runner", "tensorrt"),
    ("run", "{golden}", "--runner", "vllm", "--set", "threads=1"), ("run", "{golden}", "--diff", "--steps", "40-50"),
    ("run", "{golden}", "--set", "tensor_parallel_size=2"), ("run", "{golden}", "--runner", "vllm", "--set",
                                                                 "tensor_parallel_size=0"),
    ("run", "{golden}", "--runner", "vllm", "--set", "compilation_mode=fast"),
    ("run", "{golden}", "--runner", "vllm", "--set", "distributed_executor_backend=slurm"),
    ("run", "{golden}", "--runner", "vllm", "--set", "enforce_eager=perhaps"),
    ("bisect", "config", "{golden}", "--bad", "dtype=bfloat16", "--steps", "90-99", "-q"),
    ("bisect", "batch", "{golden}", "--step", "1", "--request", "nobody", "-q"),
    ("record", "--device", "cuda:7", "--out", "{out}"), ("record", "--device", "tpu", "--out", "{out}"),
    ("record", "--threads", "0", "--out", "{out}"),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_bad_arguments_exit_2_in_one_line(paths, capsys, case):
    args = [a.format(**paths) for a in case]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    lines = [line for line in err.strip().splitlines() if line]
    if lines and lines[0].startswith("Usage:"):  # a bare command prints its help (still exit 2)
        return
    assert len(lines) == 1 and lines[0].startswith("replay: "), err
    assert "Traceback" not in err


def test_check_maps_every_failure_to_125(paths, capsys):
    assert main(["check", paths["loop"]]) == 125
    assert main(["check", paths["cap"]]) == 125  # synthetic capture: no model to replay on
    assert main(["check", paths["cap"], "--set", "colour=red"]) == 125
    # what the parser refuses too: under `git bisect run` a flag an older commit lacks must skip it, not mark it bad
    for args in (["check"], ["check", paths["cap"], "--no-such-flag"], ["check", paths["cap"], "--jobs", "0"]):
        assert main(args) == 125, args
        assert "Traceback" not in capsys.readouterr().err
