"""The GPU check: record and replay the builtin engine on a GPU, in one run, printing one table.

    python -m bench.gpu_check                   # on a CUDA machine: `tiny` and a random 1B-class Llama in bfloat16
    python -m bench.gpu_check --device cpu      # the same checks on CPU, with a smaller Llama (same code paths)
    python -m bench.gpu_check --json            # the rows as JSON

Rows, in order (each says what it ran, its result, and its wall time):
  record tiny            `replay record` of `tiny` (float32) on the device: steps, tokens, bytes per token
  self-replay tiny       the capture re-executed on the same device: bitwise, or the largest |Δlogprob|
  record llama           a random-weight Llama written to a temporary checkpoint (1B class on CUDA: Llama-3.2-1B's
                         shape, hidden 2048, 16 layers, 32/8 heads, vocab 128256, tied; bfloat16), recorded
  self-replay llama      bitwise?
  cpu capture on DEVICE  `tiny` recorded on CPU, replayed on the device: the provenance difference `replay` names
                         first, and how far the numbers move (on `--device cpu`: the committed golden capture, which
                         names whatever differs between its recording machine and this one)
  bisect batch           the llama capture's busiest step: is one request's result the same alone and in its batch?
                         (GPU kernels are not batch-invariant: expect "depends on ...")
  bisect batch, invariant the same with `--set batch_invariant=true` (expect "batch-invariant")
  bisect leak            the same request with every neighbour's tokens swapped for others of the same shapes: GPU
                         kernels vary with the batch's shape, never with a neighbour's content (expect NO LEAK)
  bisect leak, planted   the same with a leak planted from one neighbour into one module (expect CONTAMINATION,
                         naming that neighbour)
  explain --pairs        the llama workload holds twins (one greedy prompt sent again later, into another batch):
                         the twins that part, classed (expect BATCH VARIANCE or nothing; never a bug)
  explain cpu capture    the `tiny` CPU capture replayed on the device, explained (expect CONFIG, no bug)
  trainer on DEVICE      `replay trainer --device DEVICE` on the llama capture: transformers' forward in bfloat16 on
                         the device against the builtin engine's logprobs (expect the rounding level; skipped where
                         transformers is not installed)
  tap overhead           the llama workload with and without the tap, interleaved rounds: per-step wall time (median
                         and spread) and the process's CPU time, on and off

Carrying it to a machine without a package registry (the lent H200 has torch, typer and rich, but not msgspec,
zstandard or safetensors): `bash bench/gpu_wheels.sh` here downloads their wheels into `bench/wheels/` (ignored by
git) for the Python versions such a machine may have; there, `pip install --no-index --find-links bench/wheels msgspec
zstandard safetensors` and run `PYTHONPATH=. python -m bench.gpu_check`. It finishes within 8 minutes on either
device (`--budget` seconds: rows past it are skipped and say so).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from replay.diff import Tolerance
from replay.inspect import capture_info
from replay.record import (
    EngineOptions,
    RecordOptions,
    builtin_config,
    record,
    record_builtin,
)
from replay.record.workload import SyntheticWorkload, synthetic
from replay.replayer import ReplayOptions, replay_capture

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True)
LLAMA_CPU = dict(LLAMA_1B, hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=16,
                 vocab_size=32000)  # the same architecture, small enough for a 2-core CPU in the time budget
GOLDEN = Path(__file__).resolve().parent.parent / "captures" / "tiny-mixed.capture"


@dataclass
class Row:
    """One line of the table."""

    check: str
    result: str
    seconds: float
    ok: bool | None = None  # None: a measurement, not a pass/fail check


def write_llama(path: Path, shape: dict, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """A random-weight LlamaForCausalLM checkpoint (config.json + model.safetensors), drawn on `device`."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*dims: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*dims, generator=g, device=device) * std).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors.update({p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                        p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
                        p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                        p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                        p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                        p + "mlp.down_proj.weight": rand(h, i)})
    save_file(tensors, str(path / "model.safetensors"))
    config = dict(shape, architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
                  rope_theta=500000.0, max_position_embeddings=4096, torch_dtype=str(dtype).replace("torch.", ""),
                  bos_token_id=1, eos_token_id=2)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _workload(vocab: int, n: int, out_len: tuple[int, int]) -> list:
    """Greedy and seeded requests arriving over the first steps, top-5 logprobs."""
    return synthetic(SyntheticWorkload(num_requests=n, prompt_len=(16, 64), output_len=out_len, arrival_rate=4.0),
                     vocab_size=vocab)


def _replay_row(name: str, path: Path, overrides: dict | None = None, cross: bool = False) -> Row:
    """Replay `path` with every difference measured; `cross`: recorded elsewhere, so name the leading difference."""
    t = time.perf_counter()
    rep = replay_capture(path, ReplayOptions(overrides=dict(overrides or {}), tolerance=Tolerance(atol=1e9)))
    worst = max((s.max_abs_logprob_diff for s in rep.steps), default=0.0)
    flips = sum(s.token_mismatches for s in rep.steps)
    bitwise = worst == 0.0 and flips == 0
    result = ("bitwise" if bitwise else f"max |Δlogprob| {worst:.3g}, {flips} token flips") + \
             f" over {rep.steps_replayed} steps, {rep.tokens_compared} tokens"
    if cross:
        lead = (f"names {rep.environment_differences[0]!r} first" if rep.environment_differences else
                "no provenance difference named (recorded on this kind of machine)")
        result = f"{lead}; " + result
    return Row(name, result, time.perf_counter() - t, None if cross else bitwise)


def _record_row(name: str, engine: EngineOptions, reqs: list, out: Path) -> Row:
    t = time.perf_counter()
    res = record(engine, reqs, out, overwrite=True)
    info = capture_info(out)
    return Row(name, f"{res.steps} steps, {res.generated_tokens} tokens, {res.wall_s / max(res.steps, 1) * 1e3:.1f} "
                     f"ms/step, {info.bytes_per_generated_token:.1f} B/token", time.perf_counter() - t,
               info.complete and not info.damage)


def _busiest(path: Path) -> tuple[int, str]:
    """The step with the most requests in the batch, and one of its requests that is sampled there."""
    from replay.capture import CaptureReader, Step

    best = (0, -1, "")
    with CaptureReader(path) as r:
        for rec in r.records():
            if isinstance(rec, Step) and rec.model_runner_output is not None:
                ids = rec.model_runner_output.req_ids
                if len(ids) > best[0]:
                    best = (len(ids), rec.index, ids[len(ids) // 2])
    return best[1], best[2]


def _bisect_row(name: str, path: Path, overrides: dict) -> Row:
    from replay.bisect.batch import bisect_batch

    t = time.perf_counter()
    step, rid = _busiest(path)
    res = bisect_batch(path, step, rid, overrides=overrides)
    what = ("batch-invariant" if res.batch_invariant else
            f"depends on {', '.join(res.minimal_set) or 'the batch'}; max |Δlogit| {res.max_abs_logit_diff:.3g}")
    return Row(name, f"step {step}, request {rid} of {len(res.neighbours) + 1}: {what} "
                     f"({res.re_executions} re-executions)", time.perf_counter() - t, None)


def _with_twins(reqs: list) -> list:
    """`reqs` and a twin of its first greedy request, arriving after the last of them (another batch)."""
    first = next(r for r in reqs if not r.params.temperature)
    twin = dataclasses.replace(first, request_id=f"{first.request_id}-twin",
                               arrival_step=max(r.arrival_step for r in reqs) + 3)
    return reqs + [twin]


def _leak_row(name: str, path: Path, planted: bool) -> Row:
    from replay.bisect.leak import CONTAMINATION, NO_LEAK, bisect_leak
    from replay.capture import CaptureReader, RequestAdded, Step
    from replay.replayer import Plant

    t = time.perf_counter()
    step, rid = _busiest(path)
    plant = None
    if planted:
        with CaptureReader(path) as r:
            records = list(r.records())
        ids = next(rec.model_runner_output.req_ids for rec in records if isinstance(rec, Step) and rec.index == step)
        external = {rec.request.request_id: rec.request.name for rec in records if isinstance(rec, RequestAdded)}
        neighbour = next(external[i] for i in ids if i != rid)
        plant = Plant(step, rid, "layers.1.self_attn", 0.05, neighbour)
    res = bisect_leak(path, step, rid, plant=plant)
    ok = (res.found == CONTAMINATION and res.minimal_set == [plant.source]) if plant else res.found == NO_LEAK
    moved = sum(x.neighbours_changed for x in res.tests)
    return Row(name, f"step {step}, request {rid}: {res.found}" +
               (f" from {', '.join(res.minimal_set)} at {res.first_module}" if res.minimal_set else "") +
               f" ({len(res.neighbours)} neighbours swapped, {moved} of them sampled otherwise; "
               f"{res.re_executions} re-executions)", time.perf_counter() - t, ok)


def _pairs_row(name: str, path: Path) -> Row:
    from replay.bisect.explain_pair import explain_pair, twin_groups

    t = time.perf_counter()
    groups = twin_groups(path)
    if not groups:
        return Row(name, "every twin gave the same tokens and logprobs", time.perf_counter() - t, True)
    g = groups[0]
    res = explain_pair(path, g.requests[0], g.requests[1])
    return Row(name, f"{len(groups)} group(s) part; {g.requests[0]} / {g.requests[1]} at position {g.position} "
                     f"({g.kind}, max |Δlogprob| {g.max_abs_logprob_diff:.3g}): {res.verdict}"[:400],
               time.perf_counter() - t, not res.bug)


def _explain_row(name: str, path: Path, overrides: dict) -> Row:
    from replay.bisect.explain_divergence import CONFIG, explain_divergence

    t = time.perf_counter()
    res = explain_divergence(path, ReplayOptions(overrides=dict(overrides)))
    return Row(name, res.verdict[:400], time.perf_counter() - t, res.found == CONFIG and not res.bug)


def _trainer_row(name: str, path: Path, device: str) -> Row:
    """`replay trainer` on a capture, the trainer's forward (transformers, the recording's dtype) on `device`."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return Row(name, "skipped: transformers is not installed here (bench/gpu_wheels.sh carries it)", 0.0, None)
    from replay.trainer import TrainerOptions, score_capture

    t = time.perf_counter()
    res = score_capture(path, TrainerOptions(device=device))
    o = res.overall
    return Row(name, f"{o.tokens} tokens, max |Δlogprob| {o.max_abs:.3g}, mean {o.mean_abs:.2g} ({res.dtype}: "
                     f"{'within' if res.rounding else 'BEYOND'} its rounding tolerance {res.tolerance:g})",
               time.perf_counter() - t, res.rounding and o.tokens > 0)


def _overhead_row(engine: EngineOptions, reqs: list, out: Path, rounds: int) -> Row:
    """Interleaved rounds of the same workload, tap off and on: per-step wall and process CPU time."""
    t = time.perf_counter()
    cfg = builtin_config(engine)
    per = {False: [], True: []}
    cpu = {False: [], True: []}
    for k in range(rounds):
        for tap in ((False, True) if k % 2 == 0 else (True, False)):
            c0 = resource.getrusage(resource.RUSAGE_SELF)
            c0 = c0.ru_utime + c0.ru_stime
            res = record_builtin(RecordOptions(cfg, reqs, out, overwrite=True, tap=tap))
            c1 = resource.getrusage(resource.RUSAGE_SELF)
            per[tap].append(res.wall_s / max(res.steps, 1) * 1e3)
            cpu[tap].append((c1.ru_utime + c1.ru_stime - c0) / max(res.steps, 1) * 1e3)
    off, on = statistics.median(per[False]), statistics.median(per[True])
    spread = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}"  # noqa: E731
    return Row("tap overhead", f"{rounds} rounds each: off {off:.2f} ms/step ({spread(per[False])}), on {on:.2f} "
                               f"({spread(per[True])}): {100 * (on / off - 1):+.1f} % wall; process CPU off "
                               f"{statistics.median(cpu[False]):.2f} / on {statistics.median(cpu[True]):.2f} ms/step "
                               "(the writer process's CPU is not in it)", time.perf_counter() - t, None)


def run(device: str, budget: float, rounds: int) -> list[Row]:
    """Every check, in order; a check past the time budget is skipped with that reason."""
    start = time.perf_counter()
    rows: list[Row] = []
    cuda = device.startswith("cuda")
    shape = LLAMA_1B if cuda else LLAMA_CPU
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        d = Path(tmp)
        tiny_reqs = _workload(512, 16, (8, 24))
        big_reqs = _with_twins(_workload(shape["vocab_size"], 16, (8, 24)))
        llama = EngineOptions(model=str(d / "llama"), dtype="bfloat16", device=device)

        def step(fn, *args) -> None:
            name = args[0] if isinstance(args[0], str) else fn.__name__
            if time.perf_counter() - start > budget:
                rows.append(Row(name, f"skipped: past the {budget:.0f} s budget", 0.0, None))
                return
            try:
                rows.append(fn(*args))
            except Exception as e:  # noqa: BLE001 - one failed check is a row; the others still run
                rows.append(Row(name, f"FAILED: {type(e).__name__}: {e}"[:300], 0.0, False))

        step(_record_row, "record tiny", EngineOptions(model="tiny", device=device), tiny_reqs, d / "tiny.capture")
        step(_replay_row, "self-replay tiny", d / "tiny.capture")
        t = time.perf_counter()
        write_llama(d / "llama", shape, torch.bfloat16, device)
        params = sum(p.numel() for p in _shapes(shape))
        rows.append(Row("write llama", f"{params / 1e9:.2f} B parameters, bfloat16 ({shape['num_hidden_layers']} "
                                       f"layers, hidden {shape['hidden_size']}, vocab {shape['vocab_size']})",
                        time.perf_counter() - t, None))
        step(_record_row, "record llama", llama, big_reqs, d / "llama.capture")
        step(_replay_row, "self-replay llama", d / "llama.capture")
        if cuda:
            step(_record_row, "record tiny on cpu", EngineOptions(model="tiny", device="cpu"), tiny_reqs,
                 d / "tiny-cpu.capture")
            step(_replay_row, f"cpu capture on {device}", d / "tiny-cpu.capture", {"device": device}, True)
        else:
            step(_replay_row, "golden capture here", GOLDEN, {}, True)
        step(_bisect_row, "bisect batch", d / "llama.capture", {})
        step(_bisect_row, "bisect batch, invariant", d / "llama.capture", {"batch_invariant": "true"})
        step(_leak_row, "bisect leak", d / "llama.capture", False)
        step(_leak_row, "bisect leak, planted", d / "llama.capture", True)
        step(_pairs_row, "explain --pairs", d / "llama.capture")
        if cuda:
            step(_explain_row, "explain cpu capture", d / "tiny-cpu.capture", {"device": device})
        step(_trainer_row, f"trainer on {device}", d / "llama.capture", device)
        step(_overhead_row, llama, big_reqs, d / "overhead.capture", rounds)
    return rows


def _shapes(shape: dict) -> list[torch.Size]:
    """The parameter shapes `write_llama` writes (for the parameter count)."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    layer = [torch.Size((q, h)), torch.Size((kv, h)), torch.Size((kv, h)), torch.Size((h, q)),
             torch.Size((i, h)), torch.Size((i, h)), torch.Size((h, i))]
    return [torch.Size((v, h))] + layer * shape["num_hidden_layers"]


def main(argv: list[str] | None = None) -> int:
    """Run the checks and print the table (or --json); exit 1 if a pass/fail check failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else None)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later checks are skipped past it")
    ap.add_argument("--rounds", type=int, default=3, help="tap-overhead rounds (each: tap off and on)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.device is None:
        print("gpu_check: no CUDA device here; run it with --device cpu for the same checks on CPU", file=sys.stderr)
        return 125
    t = time.perf_counter()
    rows = run(args.device, args.budget, args.rounds)
    where = (torch.cuda.get_device_name(0) if args.device.startswith("cuda") else
             f"CPU ({os.cpu_count()} cores)")
    if args.json:
        json.dump({"device": where, "torch": torch.__version__, "rows": [asdict(r) for r in rows]}, sys.stdout,
                  indent=1)
        print()
    else:
        print(f"gpu_check on {where}, torch {torch.__version__}, {time.perf_counter() - t:.0f} s in all")
        width = max(len(r.check) for r in rows)
        for r in rows:
            mark = {True: "ok  ", False: "FAIL", None: "    "}[r.ok]
            print(f"{mark} {r.check:<{width}}  {r.seconds:6.1f} s  {r.result}")
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
