"""Regenerate the golden captures and their expected outputs: `.venv/bin/python -m captures.regenerate`.

Each golden capture is recorded by the builtin engine on `tiny` (float32, one thread, sdpa attention: pinned, not
the default `batched`, so that this script still records the committed captures) with a small KV pool and token
budget, so that one short run exercises chunked prefill, prefix caching, preemption and resume, greedy, seeded
and unseeded sampling, top-k logprobs and prompt logprobs. Beside each `NAME.capture` lies
`NAME.json`: every request's output tokens and every step's sampled tokens and top-k logprobs. The tests record
the same workload again and check that the engine still produces exactly these tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from replay.capture import CaptureReader, RequestAdded, Step
from replay.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from replay.record import RecordOptions, SyntheticWorkload, record_builtin, synthetic

HERE = Path(__file__).resolve().parent

GOLDEN = {
    # name: (engine config, workload)
    "tiny-mixed": (
        EngineConfig(model="tiny",
                     scheduler=SchedulerConfig(block_size=4, num_gpu_blocks=40, max_num_seqs=6,
                                               max_num_batched_tokens=32, enable_prefix_caching=True),
                     runner=RunnerConfig(attention_impl="sdpa", num_threads=1, seed=1)),
        SyntheticWorkload(num_requests=10, prompt_len=(6, 40), output_len=(6, 20), arrival_rate=1.5,
                          shared_prefix_fraction=0.4, sampling="mixed", num_logprobs=3, seed=11),
    ),
    "tiny-prompt-logprobs": (
        EngineConfig(model="tiny",
                     scheduler=SchedulerConfig(block_size=8, num_gpu_blocks=64, max_num_seqs=4,
                                               max_num_batched_tokens=24),
                     runner=RunnerConfig(attention_impl="sdpa", num_threads=1, seed=2)),
        SyntheticWorkload(num_requests=4, prompt_len=(10, 30), output_len=(4, 8), arrival_rate=0, sampling="greedy",
                          num_logprobs=2, seed=5, defaults={"prompt_logprobs": 2}),
    ),
}


def record_golden(name: str, out_dir: Path) -> Path:
    """Record golden capture `name` into `out_dir`; returns its path."""
    cfg, wl = GOLDEN[name]
    path = out_dir / f"{name}.capture"
    record_builtin(RecordOptions(cfg, synthetic(wl, vocab_size=512), path, overwrite=True))
    return path


def expected(path: Path) -> dict:
    """What a golden capture must contain: outputs per request, sampled tokens and top-k logprobs per step."""
    outputs: dict[str, list[int]] = {}
    external: dict[str, str] = {}
    steps = []
    with CaptureReader(path) as r:
        for rec in r.records():
            if isinstance(rec, RequestAdded):
                external[rec.request.request_id] = rec.request.external_req_id or rec.request.request_id
            elif isinstance(rec, Step):
                mro = rec.model_runner_output
                row = {"step": rec.index, "sampled": {}, "logprobs": {}}
                for i, rid in enumerate(mro.req_ids):
                    ext = external[rid]
                    row["sampled"][ext] = mro.sampled_token_ids[i]
                    outputs.setdefault(ext, []).extend(mro.sampled_token_ids[i])
                    if mro.logprobs is not None:
                        row["logprobs"][ext] = [float(x) for x in mro.logprobs.logprobs.to_numpy()[i]]
                steps.append(row)
    return {"outputs": outputs, "steps": steps}


def main() -> None:
    """Rewrite every golden capture and its JSON in this directory."""
    for name in GOLDEN:
        path = record_golden(name, HERE)
        (HERE / f"{name}.json").write_text(json.dumps(expected(path), indent=1) + "\n")
        print(f"wrote {path} and {name}.json")


if __name__ == "__main__":
    main()
