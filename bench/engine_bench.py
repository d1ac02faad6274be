"""Builtin-engine benchmark: our `ModelRunner` against `transformers` eager, and the capture tap's overhead.

Part 1, runner vs transformers (CPU, float32, measured at 1 and at 2 torch threads; "ours" is the runner's default
mode, `batched` attention):

  checkpoint  a random `LlamaForCausalLM` made by transformers after `torch.manual_seed(0)` (hidden 256,
              intermediate 768, 4 layers, 4 heads / 2 KV heads, head_dim 64, vocab 32000, untied head),
              saved with `save_pretrained` to a temporary directory (HF_HUB_OFFLINE=1) and loaded
              twice: by us with `replay.engine.weights.load_checkpoint(path, torch.float32, "cpu")`, and by
              transformers with `from_pretrained(path, attn_implementation="eager")`.
  prefill     one request of 512 random prompt tokens. Ours: `ModelRunner.execute_model` on a hand-built
              SchedulerOutput (one NewRequestData, greedy, 32 blocks of 16; a fresh runner per repeat, built
              untimed). transformers: one forward of [1, 512] with use_cache=True and `logits_to_keep=1`, the way
              `generate()` prefills (our runner also computes only the last position's logits), plus the argmax.
              An extra row times the plain `model(input_ids, use_cache=True)` that computes all 512 positions'
              logits (32000 wide), for reference.
  decode      32 requests of 256 random prompt tokens, prefilled once (untimed). A repeat times S steps of one
              token for each of the 32 requests, starting at context 256. Ours: hand-built CachedRequestData
              steps (num_computed_tokens = 256 + k, num_output_tokens = outputs so far = 1 + k, a new block appended
              whenever a request's next position starts a block). transformers: `model(next_ids[:, None],
              cache=..., use_cache=True)` on the [32, 256] prefill's cache, greedy argmax between steps. Between
              repeats both sides rewind to context 256: ours by scheduling num_computed_tokens=256 with
              num_output_tokens=1 (the runner truncates its cached outputs, vLLM's diff semantics; the block tables
              already hold the blocks), transformers with `DynamicCache.crop` back to 256 positions.
              tokens/s = 32 * S / seconds.
  modes       the same prefill and decode on our runner in its other attention modes, timed in the same
              alternation: `attention_impl="sdpa"` (one attention call per request, batch-invariant attention; the
              golden captures' mode) and the batch-invariant mode (`batch_invariant=True`: tiled linears and
              per-token attention, on a second copy of the model, since the mode patches the model's linears).
              Reported as their tok/s over the default's (`batched`); `--no-modes` skips them.
  sanity      max |logit difference| between ours and transformers (1 thread) for the last position of the 512-token
              prefill, and over the 32 rows of the batched prefill and of the first decode step (transformers is fed
              the tokens our runner sampled, so both see the same inputs). Our logits are read with a forward hook
              on `lm_head` during untimed check calls.

  Each (side, threads) pair gets one untimed warm-up; then the sides alternate within each repeat (order flipped
  every repeat). Everything runs under torch.inference_mode(). Cells give the median over repeats; "best" rows use
  the minimum time, which on a noisy machine is the closest to the undisturbed cost.

Part 2, tap overhead: `replay.record.record(RecordOptions(engine=EngineConfig(model="tiny",
runner=RunnerConfig(num_threads=1)), requests=synthetic(workload, vocab_size=512), tap=True|False, ...))` on the
default `SyntheticWorkload()` and on a larger one (64 requests, output 32-64 tokens). Runs alternate on/off in ABBA
order after one untimed warm-up run of each. Reported: median `RecordResult.wall_s` (the engine loop), median wall of
the whole record() call (engine build and capture close included), capture size, bytes per generated token, and the
time the tap spent on the engine thread (`CaptureTap.encode_ns`, read from the tap record() builds: the benchmark
swaps `replay.record.CaptureTap` for a subclass that remembers its instances; nothing else changes).

Timings are medians (min alongside) because the reference machine is a noisy, shared 2-core box where 2-thread torch
runs sometimes stall for seconds; sizes and logit differences do not depend on load.

Usage (from the repository root):
    .venv/bin/python -m bench.engine_bench [--quick] [--json] [--no-modes] [--no-tap]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

import replay.record.builtin as record_mod
from replay.contracts import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from replay.engine.config import EngineConfig, RunnerConfig
from replay.engine.model_runner import ModelRunner
from replay.engine.weights import load_checkpoint
from replay.provenance import set_torch_threads
from replay.record import CaptureTap, SyntheticWorkload, synthetic

BLOCK = 16
PREFILL_LEN = 512
BATCH = 32
CONTEXT = 256
HF_CONFIG = dict(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, max_position_embeddings=2048)
SETTINGS = {  # --quick | default
    "quick": dict(repeats=5, decode_steps=8, tap_repeats=(7, 7)),
    "full": dict(repeats=9, decode_steps=16, tap_repeats=(21, 9)),
}
TAP_WORKLOADS = [("default SyntheticWorkload()", SyntheticWorkload()),
                 ("64 requests, output 32-64", SyntheticWorkload(num_requests=64, output_len=(32, 64)))]


# -- part 1: runner vs transformers ----------------------------------------------------------------------------------

def make_checkpoint(path: Path) -> None:
    """Save a random float32 LlamaForCausalLM (seed 0, the shapes above) to `path` with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep stderr to our own progress lines
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**HF_CONFIG))
    model.save_pretrained(path)


def load_both(path: Path):
    """(our CausalLM, transformers' LlamaForCausalLM with eager attention), both float32 on CPU, eval mode."""
    from transformers import LlamaForCausalLM

    ours, _, _ = load_checkpoint(path, torch.float32, "cpu")
    hf = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    hf.eval().requires_grad_(False)
    return ours, hf


def cache_kwarg(hf) -> str:
    """The name transformers' forward takes its KV cache by: `cache` (5.x) or `past_key_values` (4.x)."""
    import inspect

    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def hf_cache(out):
    """The KV cache a transformers forward returned (`.cache` in 5.x, `.past_key_values` in 4.x)."""
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


def rewind_cache(cache, ctx: int) -> None:
    """Cut a transformers DynamicCache back to its first `ctx` positions (a negative `crop` removes that many
    tokens in both transformers 4.x and 5.x; 5.x refuses the old positive "keep this many" form)."""
    extra = cache.get_seq_length() - ctx
    if extra > 0:
        cache.crop(-extra)


def new_request(rid: str, prompt: list[int], blocks: list[int]) -> NewRequestData:
    """A greedy request scheduled for the first time with block table `blocks` (one KV cache group)."""
    return NewRequestData(rid, prompt, [], SamplingParams(temperature=0.0), None, (blocks,), 0, None)


def sched(new_reqs=(), cached: CachedRequestData | None = None, tokens: dict[str, int] | None = None,
          finished=()) -> SchedulerOutput:
    """A SchedulerOutput built by hand, as tests/engine/test_model_runner.py does."""
    tokens = tokens or {}
    return SchedulerOutput(list(new_reqs), cached or CachedRequestData.make_empty(), tokens, sum(tokens.values()),
                           {}, {}, set(finished), [])


class LogitTap:
    """Collects what `lm_head` returns while active (our runner's logits, which it does not expose)."""

    def __init__(self, model):
        self.model = model
        self.out: list[torch.Tensor] = []

    @contextlib.contextmanager
    def active(self):
        """Register a forward hook on the model's lm_head for the duration of the block."""
        h = self.model.lm_head.register_forward_hook(lambda m, i, o: self.out.append(o.detach().float().clone()))
        try:
            yield self
        finally:
            h.remove()


class OurDecode:
    """32 requests prefilled in our runner, then decoded one token per request per step, rewindable to context 256."""

    def __init__(self, model, prompts: torch.Tensor, max_steps: int, **runner_kw):
        b, ctx = prompts.shape
        per_req = -(-(ctx + max_steps + 1) // BLOCK)
        self.runner = ModelRunner(model, num_blocks=b * per_req + 1, block_size=BLOCK, **runner_kw)
        self.ids = [f"d{i}" for i in range(b)]
        self.ctx = ctx
        self.next_free = 0
        self.tables: list[list[int]] = []
        for _ in range(b):
            self.tables.append(self._alloc(-(-ctx // BLOCK)))
        so = sched([new_request(r, prompts[i].tolist(), list(self.tables[i])) for i, r in enumerate(self.ids)],
                   tokens={r: ctx for r in self.ids})
        out = self.runner.execute_model(so)
        self.first_tokens = [t[0] for t in out.sampled_token_ids]

    def _alloc(self, n: int) -> list[int]:
        """Take `n` fresh block ids from the pool."""
        ids = list(range(self.next_free, self.next_free + n))
        self.next_free += n
        return ids

    def step(self, k: int):
        """Decode step k (0-based from context 256): each request computes position 256 + k, with 1 + k outputs so
        far; a block is appended to a request's table when that position starts a new block."""
        pos = self.ctx + k
        new_blocks = []
        for table in self.tables:
            if pos // BLOCK >= len(table):
                blk = self._alloc(1)
                table.extend(blk)
                new_blocks.append((blk,))
            else:
                new_blocks.append(None)
        n = len(self.ids)
        cr = CachedRequestData(list(self.ids), set(), [], {}, new_blocks, [pos] * n, [1 + k] * n)
        return self.runner.execute_model(sched(cached=cr, tokens={r: 1 for r in self.ids}))

    def run(self, steps: int) -> float:
        """Time `steps` decode steps from context 256 (k = 0 rewinds any earlier run); seconds."""
        t = time.perf_counter()
        for k in range(steps):
            self.step(k)
        return time.perf_counter() - t


class HFDecode:
    """The same decode in transformers: one [32, 256] prefill, then single-token forwards on its DynamicCache."""

    def __init__(self, hf, prompts: torch.Tensor, first_tokens: list[int]):
        self.hf = hf
        self.kw = cache_kwarg(hf)
        self.ctx = prompts.shape[1]
        with torch.inference_mode():
            out = hf(prompts, use_cache=True, logits_to_keep=1)
        self.prefill_logits = out.logits[:, -1].float()
        self.cache = hf_cache(out)
        # fed the tokens our runner sampled, so the two decodes see the same inputs
        self.first = torch.tensor(first_tokens, dtype=torch.long)

    def step(self, next_ids: torch.Tensor) -> torch.Tensor:
        """One forward of one token per sequence; returns the [32, vocab] logits."""
        out = self.hf(next_ids[:, None], use_cache=True, **{self.kw: self.cache})
        return out.logits[:, -1]

    def run(self, steps: int) -> float:
        """Rewind the cache to context 256 and time `steps` greedy decode steps; seconds."""
        with torch.inference_mode():
            rewind_cache(self.cache, self.ctx)
            nxt = self.first
            t = time.perf_counter()
            for _ in range(steps):
                nxt = self.step(nxt).argmax(-1)
            return time.perf_counter() - t


def time_our_prefill(model, prompt: list[int], **runner_kw) -> float:
    """Seconds of one `execute_model` prefilling `prompt` in a fresh runner (built untimed; `runner_kw`: its
    attention mode)."""
    runner = ModelRunner(model, num_blocks=-(-len(prompt) // BLOCK) + 1, block_size=BLOCK, **runner_kw)
    so = sched([new_request("p", prompt, list(range(-(-len(prompt) // BLOCK))))], tokens={"p": len(prompt)})
    t = time.perf_counter()
    runner.execute_model(so)
    return time.perf_counter() - t


def time_hf_prefill(hf, ids: torch.Tensor, last_only: bool) -> float:
    """Seconds of one transformers forward over `ids` [1, n] with use_cache=True (+ argmax of the last position).
    `last_only` passes logits_to_keep=1 (what generate() does); otherwise all n positions' logits are computed."""
    kw = {"logits_to_keep": 1} if last_only else {}
    with torch.inference_mode():
        t = time.perf_counter()
        out = hf(ids, use_cache=True, **kw)
        out.logits[:, -1].argmax(-1)
        return time.perf_counter() - t


def logit_checks(ours, hf, prompt: torch.Tensor, dec: OurDecode, hdec: HFDecode, tap: LogitTap) -> dict:
    """Max |Δlogit| ours vs transformers: last position of the 512-token prefill, and the first decode step of the
    batch of 32 (transformers fed the tokens our runner sampled). Leaves both decodes at context 257."""
    with torch.inference_mode():
        runner = ModelRunner(ours, num_blocks=PREFILL_LEN // BLOCK + 1, block_size=BLOCK)
        with tap.active():
            tap.out.clear()
            runner.execute_model(sched([new_request("c", prompt.tolist(), list(range(PREFILL_LEN // BLOCK)))],
                                       tokens={"c": PREFILL_LEN}))
        ref = hf(prompt[None], use_cache=True).logits[0, -1].float()
        d_prefill = (tap.out[-1][0] - ref).abs().max().item()
        with tap.active():
            tap.out.clear()
            dec.step(0)
        rewind_cache(hdec.cache, hdec.ctx)
        ref_dec = hdec.step(hdec.first).float()
        d_decode = (tap.out[-1] - ref_dec).abs().max().item()
    return {"prefill_512_last": d_prefill, "decode_step_b32": d_decode}


def med_min(xs: list[float]) -> dict:
    """Median and min of a list of seconds, and every sample."""
    return {"median_s": statistics.median(xs), "min_s": min(xs), "samples_s": xs}


def bench_threads(threads: int, ours, hf, prompt: torch.Tensor, dec: OurDecode, hdec: HFDecode, repeats: int,
                  steps: int, modes: dict | None = None) -> dict:
    """Prefill and decode timings of both sides at `threads` torch threads, sides alternating within each repeat.
    `modes` ({"ours_sdpa" | "ours_invariant": (model, runner kwargs, OurDecode)}) adds our other attention modes."""
    set_torch_threads(threads)
    plist = prompt.tolist()
    ids = prompt[None]
    prefill = {
        "ours": lambda: time_our_prefill(ours, plist),
        "hf": lambda: time_hf_prefill(hf, ids, last_only=True),
        "hf_all_logits": lambda: time_hf_prefill(hf, ids, last_only=False),
    }
    decode = {"ours": lambda: dec.run(steps), "hf": lambda: hdec.run(steps)}
    for name, (model, kw, mdec) in (modes or {}).items():
        prefill[name] = (lambda m, k: lambda: time_our_prefill(m, plist, **k))(model, kw)
        decode[name] = (lambda d: lambda: d.run(steps))(mdec)
    res: dict = {"threads": threads}
    for kind, fns in (("prefill", prefill), ("decode", decode)):
        for fn in fns.values():  # warm-up
            fn()
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for rep in range(repeats):
            order = list(fns) if rep % 2 == 0 else list(reversed(fns))
            for k in order:
                samples[k].append(fns[k]())
        res[kind] = {k: med_min(v) for k, v in samples.items()}
    for v in res["prefill"].values():
        v["tok_s"], v["tok_s_best"] = PREFILL_LEN / v["median_s"], PREFILL_LEN / v["min_s"]
    for v in res["decode"].values():
        v["tok_s"], v["tok_s_best"] = BATCH * steps / v["median_s"], BATCH * steps / v["min_s"]
        v["step_ms_median"], v["step_ms_min"] = v["median_s"] / steps * 1e3, v["min_s"] / steps * 1e3
    return res


def bench_models(tmp: Path, repeats: int, steps: int, with_modes: bool = True) -> dict:
    """Part 1: build the checkpoint, load it both ways, check logits, time at 1 and 2 threads (and our other
    attention modes with `with_modes`)."""
    ckpt = tmp / "llama-tiny-32k"
    set_torch_threads(1)
    t = time.perf_counter()
    make_checkpoint(ckpt)
    ours, hf = load_both(ckpt)
    setup_s = time.perf_counter() - t
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, HF_CONFIG["vocab_size"], (PREFILL_LEN,), generator=g)
    prompts = torch.randint(3, HF_CONFIG["vocab_size"], (BATCH, CONTEXT), generator=g)
    tap = LogitTap(ours)
    with tap.active():
        dec = OurDecode(ours, prompts, steps)
    ours_b32 = tap.out[-1]  # [32, vocab]: the last position of each request of the batched prefill
    hdec = HFDecode(hf, prompts, dec.first_tokens)
    checks = logit_checks(ours, hf, prompt, dec, hdec, tap)
    checks["prefill_b32_last"] = (ours_b32 - hdec.prefill_logits).abs().max().item()
    modes = {}
    if with_modes:
        invariant, _, _ = load_checkpoint(ckpt, torch.float32, "cpu")  # its own copy: the mode patches its linears
        for name, model, kw in (("ours_sdpa", ours, {"attention_impl": "sdpa"}),
                                ("ours_invariant", invariant, {"batch_invariant": True})):
            modes[name] = (model, kw, OurDecode(model, prompts, steps, **kw))
    results = [bench_threads(n, ours, hf, prompt, dec, hdec, repeats, steps, modes) for n in (1, 2)]
    return {"setup_s": setup_s, "repeats": repeats, "decode_steps": steps, "logit_max_abs_diff": checks,
            "threads": results}


# -- part 2: tap overhead --------------------------------------------------------------------------------------------

class _SeenTap(CaptureTap):
    """CaptureTap that remembers its instances, so the benchmark can read `encode_ns` after record() returns."""

    instances: list[CaptureTap] = []

    def __init__(self, writer):
        super().__init__(writer)
        _SeenTap.instances.append(self)


def record_once(workload: SyntheticWorkload, out: Path, tap: bool) -> dict:
    """One record() run with the tap on or off: its RecordResult, the whole call's wall, the tap's encode time."""
    opts = record_mod.RecordOptions(engine=EngineConfig(model="tiny", runner=RunnerConfig(num_threads=1)),
                                    requests=synthetic(workload, vocab_size=512), out=out, overwrite=True, tap=tap)
    _SeenTap.instances.clear()
    t = time.perf_counter()
    r = record_mod.record_builtin(opts)
    total = time.perf_counter() - t
    enc = _SeenTap.instances[-1].encode_ns / 1e9 if tap and _SeenTap.instances else None
    return {"wall_s": r.wall_s, "total_s": total, "encode_s": enc, "capture_bytes": r.capture_bytes,
            "generated_tokens": r.generated_tokens, "steps": r.steps, "requests": r.requests}


def bench_tap(tmp: Path, name: str, workload: SyntheticWorkload, repeats: int) -> dict:
    """Alternate tap on/off runs (ABBA) `repeats` times each after one warm-up of each; medians and mins."""
    original = record_mod.CaptureTap
    record_mod.CaptureTap = _SeenTap
    try:
        record_once(workload, tmp / "warm.capture", True)
        record_once(workload, tmp / "warm.capture", False)
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        for rep in range(repeats):
            for tap in ((True, False) if rep % 2 == 0 else (False, True)):
                runs["on" if tap else "off"].append(record_once(workload, tmp / "x.capture", tap))
    finally:
        record_mod.CaptureTap = original
    med = statistics.median
    out: dict = {"name": name, "repeats": repeats, "steps": runs["on"][0]["steps"],
                 "requests": runs["on"][0]["requests"], "generated_tokens": runs["on"][0]["generated_tokens"]}
    for side, rs in runs.items():
        out[side] = {"wall_s_median": med(r["wall_s"] for r in rs), "wall_s_min": min(r["wall_s"] for r in rs),
                     "total_s_median": med(r["total_s"] for r in rs), "total_s_min": min(r["total_s"] for r in rs),
                     "wall_s_samples": [r["wall_s"] for r in rs]}
    on = runs["on"]
    out["capture_bytes"] = med(r["capture_bytes"] for r in on)
    out["bytes_per_gen_token"] = out["capture_bytes"] / out["generated_tokens"]
    encs = [r["encode_s"] for r in on if r["encode_s"] is not None]
    out["encode_s_median"] = med(encs) if encs else None
    out["encode_share_median"] = med(r["encode_s"] / r["wall_s"] for r in on if r["encode_s"]) if encs else None
    out["ratio_wall"] = out["on"]["wall_s_median"] / out["off"]["wall_s_median"]
    out["ratio_total"] = out["on"]["total_s_median"] / out["off"]["total_s_median"]
    return out


# -- report ----------------------------------------------------------------------------------------------------------

def machine() -> dict:
    """Facts about this machine and the libraries, for the header line."""
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_default_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_count": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform()}


def targets(models: dict, taps: list[dict]) -> list[dict]:
    """The pass/fail targets, each with the measured number it was judged on."""
    out = []
    for t in models["threads"]:
        n = t["threads"]
        for kind in ("prefill", "decode"):
            r = t[kind]["ours"]["tok_s"] / t[kind]["hf"]["tok_s"]
            out.append((f"{kind} tok/s ours/transformers >= 1.0 ({n} thread{'s' * (n > 1)}, medians)", r, r >= 1.0))
    worst = max(models["logit_max_abs_diff"].values())
    out.append(("max |Δlogit| ours vs transformers < 1e-4 (worst of the checks)", worst, worst < 1e-4))
    for tp in taps:
        out.append((f"tap on/off wall <= 1.03 ({tp['name']}, engine loop, medians)", tp["ratio_wall"],
                    tp["ratio_wall"] <= 1.03))
    return [{"target": name, "measured": v, "pass": bool(ok)} for name, v, ok in out]


def render(m: dict, models: dict, taps: list[dict], tg: list[dict]) -> str:
    """The plain-text report: machine line, one side-by-side table, targets."""
    la = m["loadavg"]
    lines = [f"machine: python {m['python']}, torch {m['torch']} ({m['cpu_capability']}), transformers "
             f"{m['transformers']}, torch default threads {m['torch_default_threads']}, {m['cpu_count']} CPUs, "
             f"load {la[0]} {la[1]} {la[2]}, {m['platform']}",
             f"timings: median of {models['repeats']} repeats (runner/transformers)"
             + (f" and of {taps[0]['repeats']} / {taps[-1]['repeats']} runs (tap)" if taps else "")
             + ", min alongside; shared noisy 2-core machine, 2-thread runs may stall",
             ""]
    row = "{:<34} {:<38} {:>14} {:>14} {:>9}"
    lines += [row.format("", "metric", "A", "B", "A/B"), "-" * 113]
    S = models["decode_steps"]
    lines.append("runner vs transformers eager, fp32 CPU, vocab 32000 (A = ours ModelRunner, B = transformers)")
    for t in models["threads"]:
        n = t["threads"]
        p, d = t["prefill"], t["decode"]
        first = [f"  {n} thread{'s' if n > 1 else ''}"]

        def pair(metric, a, b, f="{:.0f}", ratio=True):
            """One A/B row; the thread label goes on the first row of its block."""
            label = first.pop() if first else ""
            return row.format(label, metric, f.format(a), f.format(b), f"{a / b:.2f}x" if ratio and b else "-")

        lines.append(pair("prefill 512 tok/s (median)", p["ours"]["tok_s"], p["hf"]["tok_s"]))
        lines.append(pair("prefill 512 tok/s (best)", p["ours"]["tok_s_best"], p["hf"]["tok_s_best"]))
        lines.append(pair("prefill 512 ms, median", p["ours"]["median_s"] * 1e3, p["hf"]["median_s"] * 1e3,
                          "{:.1f}", ratio=False))
        lines.append(pair("  B = model(ids): all 512 pos. logits", p["ours"]["tok_s"], p["hf_all_logits"]["tok_s"]))
        lines.append(pair(f"decode b{BATCH} ctx{CONTEXT} tok/s (median)", d["ours"]["tok_s"], d["hf"]["tok_s"]))
        lines.append(pair(f"decode b{BATCH} ctx{CONTEXT} tok/s (best)", d["ours"]["tok_s_best"], d["hf"]["tok_s_best"]))
        lines.append(pair("decode step ms, median", d["ours"]["step_ms_median"], d["hf"]["step_ms_median"], "{:.1f}",
                          ratio=False))
        lines.append(pair("decode step ms, min", d["ours"]["step_ms_min"], d["hf"]["step_ms_min"], "{:.1f}",
                          ratio=False))
        for mode, what in (("ours_sdpa", "sdpa per request"), ("ours_invariant", "batch-invariant")):
            if mode in p:  # A = ours in that mode, B = ours in the default mode (batched attention)
                lines.append(pair(f"  {what}: prefill tok/s", p[mode]["tok_s"], p["ours"]["tok_s"]))
                lines.append(pair(f"  {what}: decode tok/s", d[mode]["tok_s"], d["ours"]["tok_s"]))
    c = models["logit_max_abs_diff"]
    lines.append(row.format("  check (1 thread)", "max|Δlogit| prefill 512, last pos", f"{c['prefill_512_last']:.2e}",
                            "-", "-"))
    lines.append(row.format("", "max|Δlogit| prefill b32x256, last pos", f"{c['prefill_b32_last']:.2e}", "-", "-"))
    lines.append(row.format("", "max|Δlogit| first decode step, b32", f"{c['decode_step_b32']:.2e}", "-", "-"))
    lines.append("")
    lines.append("tap overhead: replay.record.record(), tiny model, 1 thread (A = tap on, B = tap off)")
    for tp in taps:
        lab = [f"  {tp['name']}", f"  {tp['requests']} req, {tp['steps']} steps, {tp['generated_tokens']} gen tok"]
        on, off = tp["on"], tp["off"]
        rows = [("engine loop wall s (median)", f"{on['wall_s_median']:.3f}", f"{off['wall_s_median']:.3f}",
                 f"{tp['ratio_wall']:.3f}"),
                ("engine loop wall s (min)", f"{on['wall_s_min']:.3f}", f"{off['wall_s_min']:.3f}",
                 f"{on['wall_s_min'] / off['wall_s_min']:.3f}"),
                ("record() call s, build+close (median)", f"{on['total_s_median']:.3f}", f"{off['total_s_median']:.3f}",
                 f"{tp['ratio_total']:.3f}"),
                ("capture bytes", f"{tp['capture_bytes']:,.0f}", "-", "-"),
                ("bytes / generated token", f"{tp['bytes_per_gen_token']:.1f}", "-", "-")]
        if tp["encode_s_median"] is not None:
            rows.append(("tap time on engine thread ms (median)", f"{tp['encode_s_median'] * 1e3:.1f}", "-", "-"))
            rows.append(("  share of engine loop wall", f"{tp['encode_share_median'] * 100:.1f} %", "-", "-"))
        for i, (metric, a, b, r) in enumerate(rows):
            lines.append(row.format(lab[i] if i < len(lab) else "", metric, a, b, r))
    lines.append("")
    lines.append(f"A/B: ours/transformers (above 1 = ours faster) for tok/s; tap on/off (below 1.03 = target) for "
                 f"walls. "
                 f"decode: {S} steps per repeat from context {CONTEXT}. B prefill uses logits_to_keep=1 like "
                  "generate()")
    lines.append("mode rows (sdpa per request, batch-invariant): A = ours in that mode, B = ours by default (batched "
                 "attention); below 1 = the mode's cost")
    lines += ["", "targets:"]
    for t in tg:
        v = t["measured"]
        lines.append(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['target']}: measured {v:.2e}" if v < 0.01 else
                     f"  {'PASS' if t['pass'] else 'FAIL'}  {t['target']}: measured {v:.3f}")
    return "\n".join(lines)


def main() -> None:
    """Parse flags, run both parts, print the table (or JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="5 repeats, 8 decode steps, 7 tap runs per workload")
    ap.add_argument("--json", action="store_true", help="print the same numbers as JSON")
    ap.add_argument("--no-modes", action="store_true", help="skip our sdpa and batch-invariant attention modes")
    ap.add_argument("--no-tap", action="store_true", help="skip part 2 (tap overhead)")
    args = ap.parse_args()
    s = SETTINGS["quick" if args.quick else "full"]
    m = machine()
    with tempfile.TemporaryDirectory(prefix="engine_bench-") as d:
        tmp = Path(d)
        print("[runner vs transformers] ...", file=sys.stderr, flush=True)
        models = bench_models(tmp, s["repeats"], s["decode_steps"], not args.no_modes)
        taps = []
        for (name, w), n in zip(TAP_WORKLOADS, s["tap_repeats"]) if not args.no_tap else ():
            print(f"[tap overhead: {name}] ...", file=sys.stderr, flush=True)
            taps.append(bench_tap(tmp, name, w, n))
    tg = targets(models, taps)
    if args.json:
        print(json.dumps({"machine": m, "models": models, "tap": taps, "targets": tg}, indent=2))
    else:
        print(render(m, models, taps, tg))


if __name__ == "__main__":
    main()
