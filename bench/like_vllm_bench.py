"""What `replay trainer`'s like-for-like pass costs at a real vocabulary: vLLM's processed logprobs recomputed from
the trainer's logits (`replay.trainer.semantics.like_vllm`), where top-p needs the tokens it keeps.

A rollout of 512 generated tokens at 151,936 ids, processed_logprobs: rows shaped as a trained model's
(`testbed.logits.peaked_logits`) and flat rows (as a random-weight model gives), at temperature 0.7 with top-p 0.9,
and with top-k 50 then top-p 0.95. Each case runs three ways: as the pass was (a row at a time, top-p as vLLM
decides it, by a sort), 64 rows at once with the sort, and as it is (`replay.engine.top_p`: the top 1,024, then
16,384, tokens where they decide it; the sort for the rest). Rounds rotate the three.
Wall and CPU milliseconds per generated token, median (min-max); and that all three give the same bits.

    .venv/bin/python -m bench.like_vllm_bench [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from replay.contracts import SamplingParams
from replay.engine import top_p
from replay.engine.sampler import filtered
from replay.trainer.semantics import like_vllm, semantics
from testbed.logits import QWEN_VOCAB, peaked_logits

TOKENS = 512
PARAMS = {"top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
          "top-k 50, top-p 0.95": SamplingParams(temperature=0.7, top_k=50, top_p=0.95)}


WAYS = {"rows": "sorted, a row at a time (before)", "sort": "sorted, 64 rows at once",
        "short": "the top tokens, else sorted (now)"}


def _row_by_row(z: torch.Tensor, s) -> torch.Tensor:
    """`like_vllm` as it was: each row filtered on its own, top-p by the sort."""
    return torch.log_softmax(torch.stack([filtered(row, s.params) for row in z]), dim=-1)


def _rows(kind: str) -> torch.Tensor:
    if kind == "peaked":
        return peaked_logits(TOKENS, 0)
    return torch.randn((TOKENS, QWEN_VOCAB), generator=torch.Generator().manual_seed(0))


def main() -> None:
    """Run the rounds and print the table (or --json)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    default = top_p.TOPS
    rows = {kind: _rows(kind) for kind in ("peaked", "flat")}
    times: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    same = True
    for r in range(args.rounds):
        for kind, z in rows.items():
            for name, params in PARAMS.items():
                s = semantics(params, "processed_logprobs")
                out = {}
                hows = ["rows", "sort", "short"]
                for how in hows[r % 3:] + hows[:r % 3]:
                    top_p.TOPS = default if how == "short" else ()
                    wall, cpu = time.perf_counter(), time.process_time()
                    out[how] = like_vllm(z, s) if how != "rows" else _row_by_row(z, s)
                    times.setdefault((kind, name, how), []).append(
                        ((time.perf_counter() - wall) / TOKENS * 1e3, (time.process_time() - cpu) / TOKENS * 1e3))
                same &= torch.equal(out["sort"], out["short"]) and torch.equal(out["rows"], out["short"])
    top_p.TOPS = default
    table = {" / ".join(k): {"wall_ms_per_token": [w for w, _ in v], "cpu_ms_per_token": [c for _, c in v]}
             for k, v in times.items()}
    if args.json:
        print(json.dumps({"tokens": TOKENS, "vocab": QWEN_VOCAB, "same_bits": same, "cases": table}))
        return
    print(f"like_vllm over {TOKENS} tokens at {QWEN_VOCAB:,} ids, processed_logprobs, {args.rounds} rounds; "
          f"ms per token, median (min-max); same bits both ways: {same}")
    print("| rows | sampling | top-p | wall | CPU |\n|---|---|---|---|---|")
    for (kind, name, how), v in times.items():
        w, c = [x for x, _ in v], [x for _, x in v]
        print(f"| {kind} | {name} | {WAYS[how]} | {_spread(w)} | {_spread(c)} |")


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


if __name__ == "__main__":
    main()
