"""Whether a torch upgrade changes what the builtin runner computes on this machine: one environment per torch
version, the same builtin captures (recorded with `.venv`'s torch) replayed bitwise in each.

    .venv/bin/python -m bench.torch_matrix [--versions 2.7.1,2.9.1,2.12.1,2.14.1] [--write-docs]

Each environment (`bench/out/matrix/torch-X/`) is a venv holding torch X as PyPI ships it, with the CUDA libraries
it pins (a CUDA build runs on the CPU; 4-7 GB each, downloaded the first time, except what lies on this machine's
disk), and a `.pth` that puts this checkout's `.venv` site-packages after it (transformers, replay itself).
`--write-docs` replaces the table between the `<!-- torch -->` markers of docs/vllm.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from bench.docs_block import write_block
from bench.version_matrix import OUT, ROOT, layered_environment

START, END = "<!-- torch -->", "<!-- /torch -->"
# (case, model builder in testbed/checkpoints or "tiny", `replay record` arguments)
CASES = [
    ("tiny, float32", "tiny", []),
    ("tiny, bfloat16", "tiny", ["--dtype", "bfloat16"]),
    ("tiny, float16, sdpa", "tiny", ["--dtype", "float16", "--attention", "sdpa"]),
    ("wide Llama (512), float32", "wide_llama", []),
    ("wide Llama (512), bfloat16", "wide_llama", ["--dtype", "bfloat16"]),
    ("Qwen2, 151,936 ids, float32", "real_vocab_qwen2", []),
    ("Qwen2, 151,936 ids, bfloat16, sdpa, 300-600-token prompts", "real_vocab_qwen2",
     ["--dtype", "bfloat16", "--attention", "sdpa", "--prompt-len", "300:600", "--num-requests", "6",
      "--max-model-len", "1024", "--max-num-batched-tokens", "2048"]),
]


def environment(version: str) -> Path:
    """The python of an environment running torch `version` (and the CUDA libraries it pins), made if it is not
    there."""
    return layered_environment(OUT / f"torch-{version}", f"torch=={version}")


def replay(py: Path, capture: Path) -> str:
    """`replay run CAPTURE --diff` in an environment, as a table cell."""
    out = subprocess.run([str(py), "-m", "replay.cli", "run", str(capture), "--diff", "--json"], capture_output=True,
                         text=True, cwd=ROOT, timeout=900)
    try:
        rep = json.loads(out.stdout)
    except json.JSONDecodeError:
        return "error: " + ((out.stderr.strip().splitlines() or ["?"])[-1][:120])
    if not rep["diverged"]:
        return "MATCH"
    first = rep["first_divergence"]
    return f"DIVERGED at step {first['step']} (max \\|Δlogprob\\| {first['max_abs_logprob_diff']:.2g})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", default="2.7.1,2.9.1,2.12.1,2.14.1")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    import torch

    import testbed.checkpoints as checkpoints

    work = Path(tempfile.mkdtemp(prefix="torch-matrix-"))
    replay_cli = Path(sysconfig.get_paths()["scripts"]) / "replay"
    captures = []
    for i, (name, model, extra) in enumerate(CASES):
        path = "tiny" if model == "tiny" else str(work / model)
        if model != "tiny" and not Path(path).exists():
            getattr(checkpoints, model)(Path(path))
        cap = work / f"case{i}.capture"
        subprocess.run([str(replay_cli), "record", "-m", path, "-o", str(cap), *extra], check=True, capture_output=True)
        captures.append(cap)
    versions = args.versions.split(",")
    cells = {v: [replay(environment(v), cap) for cap in captures] for v in versions}
    head = [f"builtin capture (recorded with torch {torch.__version__})", *[f"torch {v}" for v in versions]]
    table = "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                      ["| " + " | ".join([name, *(cells[v][i] for v in versions)]) + " |"
                       for i, (name, _, _) in enumerate(CASES)])
    print(table)
    if args.write_docs:
        write_block(ROOT / "docs" / "vllm.md", START, END, table)


if __name__ == "__main__":
    main()
