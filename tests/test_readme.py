"""The README is a user's guide that stays true: at most 350 lines, the vLLM server recipe within its first 120,
links that lead somewhere, and the demo sample in the shape `replay demo` prints today (the verdict line, the
counts, the first divergence and the first token flip; the numbers themselves follow the processor's bfloat16
kernels). `REPLAY_WRITE_README=1` rewrites the sample from this machine's demo."""

from __future__ import annotations

import os
import re
from pathlib import Path

from replay.cli.render_replay import render_demo
from replay.demo import run_demo

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- demo:begin -->\n```\n", "```\n<!-- demo:end -->"
SHOWN = "captures/demo.capture"  # the path the sample shows (the test records elsewhere)


def _sample(demo_text: str) -> str:
    """The bfloat16 replay's lines of the demo's output, down to the first token flip's numbers."""
    lines = demo_text.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("$ replay run") and "bfloat16" in x)
    flip = next(i for i in range(start, len(lines)) if lines[i] == "first token flip:")
    return "\n".join(lines[start:flip + 3]) + "\n"


def _shape(text: str) -> list[str]:
    """Each line with its numbers and flip class masked, and the first divergence's details cut after its place:
    what must not drift, whatever the processor computes."""
    out = []
    for line in text.splitlines():
        line = re.sub(r"\b(TIE|CONFIDENT|NOT-ARGMAX) FLIP\b", "CLASS FLIP", line)
        if re.match(r"  step \d+, request \S+, output position \d+: same token", line):
            line = line.split(": same token")[0] + ": same token ..."
        out.append(re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "#", line))
    return out


def test_the_readme_is_a_guide_of_at_most_350_lines_with_the_server_recipe_first():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 350
    recipe = next(i for i, x in enumerate(lines) if x.startswith("## Record a vLLM server"))
    assert recipe < 120
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), target


def test_the_readme_demo_sample_has_the_shape_replay_demo_prints(tmp_path):
    res = run_demo(tmp_path / "demo.capture")
    now = _sample(render_demo(res).replace(str(tmp_path / "demo.capture"), SHOWN))
    text = README.read_text()
    head, rest = text.split(BEGIN, 1)
    shown, tail = rest.split(END, 1)
    if os.environ.get("REPLAY_WRITE_README") == "1":
        README.write_text(f"{head}{BEGIN}{now}{END}{tail}")
        shown = now
    assert _shape(shown) == _shape(now), f"the README's demo sample no longer has the demo's shape; it prints:\n{now}"
