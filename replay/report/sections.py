"""The run's part of the report, from `RunFacts`: provenance tables, headline numbers, the step timeline's binned
series and the request table's columns."""

from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np

from replay.capture import Header
from replay.provenance import hardware_summary
from replay.report.bins import MAX_COLUMNS, bin_of, bin_starts, reduce_bins, rounded
from replay.report.run_facts import RunFacts


def provenance(header: Header, status: str) -> list[tuple[str, list[tuple[str, Any]]]]:
    """(section, facts) for the model, the engine and its configuration, the layout, the hardware and the
    environment, as the capture's header records them."""
    m, c, e = header.model, header.engine_config, header.environment
    created = dt.datetime.fromtimestamp(header.created, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    model = [] if m is None else [("name", m.name), ("architecture", m.architecture), ("dtype", m.dtype),
                                  ("weights fingerprint", m.fingerprint[:16]), ("path", m.path)]
    engine = [("engine", f"{header.engine} {header.engine_version}".strip()),
              ("recorded", f"{created} by replay {header.tool_version}, format "
                           f"{header.format_version[0]}.{header.format_version[1]}"),
              ("status", status), ("block size", c.block_size), ("KV blocks", c.num_gpu_blocks or None),
              ("max seqs", c.max_num_seqs or None), ("max batched tokens", c.max_num_batched_tokens or None),
              ("max model len", c.max_model_len or None), ("prefix caching", _on(c.enable_prefix_caching)),
              ("chunked prefill", _on(c.enable_chunked_prefill)), ("attention", c.attention_impl),
              ("seed", c.seed), ("logprobs mode", c.logprobs_mode), ("async scheduling", _on(c.async_scheduling)),
              ("batch invariant", _on(c.batch_invariant)), ("runner", c.runner_class)]
    engine += [(k, v) for k, v in sorted(c.extra.items()) if not isinstance(v, (dict, list))]
    hardware = [("summary", hardware_summary(e.hardware) if e.hardware else "not recorded")]
    hardware += sorted(e.hardware.items())
    if e.libraries.get("cpu_capability"):
        hardware.append(("ATen kernels", e.libraries["cpu_capability"]))
    env = [("device", e.device), ("torch", e.torch_version), ("CUDA", e.cuda_version),
           ("threads", e.num_threads or None),
           ("deterministic algorithms", _on(e.deterministic_algorithms)), ("float32 matmul precision",
                                                                             e.matmul_precision),
           ("python", e.python_version), ("platform", e.platform), ("host", e.hostname)]
    env += [(k, v) for k, v in sorted(e.libraries.items()) if k != "cpu_capability"]
    variables = sorted(e.env.items())
    keep = lambda facts: [(k, v) for k, v in facts if v not in (None, "")]  # noqa: E731
    return [("Model", keep(model)), ("Engine", keep(engine)), ("Layout", sorted(c.layout.items())),
            ("Hardware", keep(hardware)), ("Environment", keep(env)), ("Environment variables", variables)]


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def run_stats(run: RunFacts) -> list[tuple[str, Any]]:
    """The headline numbers of the run."""
    s, n = run.series, len(run.index)
    span = f" ({run.index[0]}–{run.index[-1]})" if n else ""
    out = [("steps" + span, f"{n:,}"), ("requests", f"{len(run.requests):,}"),
           ("prompt tokens", f"{sum(f.prompt_len or 0 for f in run.requests.values()):,}"),
           ("generated tokens", f"{sum(f.tokens for f in run.requests.values()):,}"),
           ("scheduled tokens", f"{int(s['prefill'].sum() + s['decode'].sum()):,}"),
           ("preemptions", f"{int(s['preempted'].sum()):,}"), ("prefix-cache hits", f"{int(s['prefix_hits'].sum()):,}")]
    if run.timed:
        out.append(("engine time (s)",
                    f"{(s['schedule_ns'].sum() + s['execute_ns'].sum() + s['update_ns'].sum()) / 1e9:.3f}"))
    out.append(("capture status", run.status))
    return out


def steps_data(run: RunFacts) -> dict[str, Any]:
    """The timeline's series, binned into at most MAX_COLUMNS columns of consecutive steps: means (and peaks) of
    the batch, its tokens and its time; counts of preemptions and prefix hits; crashes by column."""
    n, s = len(run.index), run.series
    if not n:
        return {"n": 0, "cols": 0, "binning": "no steps", "timed": 0}
    starts = bin_starts(n, MAX_COLUMNS)
    ends = np.append(starts[1:], n) - 1
    mean = lambda v, d=2: rounded(reduce_bins(v, starts, "mean"), d)  # noqa: E731
    total_ms = (s["schedule_ns"] + s["execute_ns"] + s["update_ns"]) / 1e6
    k = len(starts)
    per = n / k
    binning = ("one column per step" if k == n else
               f"{n:,} steps in {k:,} columns of {int(per)}–{int(np.ceil(per))} steps each: bars are the column's "
               "means, the line its peak")
    return {
        "n": n, "cols": k, "binning": binning, "timed": run.timed,
        "start": run.index[starts].tolist(), "end": run.index[ends].tolist(),
        "requests_mean": mean(s["requests"]), "requests_max": rounded(reduce_bins(s["requests"], starts, "max")),
        "prefill": mean(s["prefill"]), "decode": mean(s["decode"]),
        "tokens_max": rounded(reduce_bins(s["prefill"] + s["decode"], starts, "max")),
        "schedule": mean(s["schedule_ns"] / 1e6, 3), "execute": mean(s["execute_ns"] / 1e6, 3),
        "update": mean(s["update_ns"] / 1e6, 3), "time_max": rounded(reduce_bins(total_ms, starts, "max"), 3),
        "preempted": rounded(reduce_bins(s["preempted"], starts, "sum")),
        "prefix_hits": rounded(reduce_bins(s["prefix_hits"], starts, "sum")),
        "crashes": [[int(bin_of(run.position(step), n, MAX_COLUMNS)), step, text] for step, text in run.crashes],
    }


def request_table(run: RunFacts, extra: dict[str, list] | None = None) -> dict[str, Any]:
    """The request table, column by column (request order: arrival); `extra` adds a comparison's columns."""
    fs, idx = list(run.requests.values()), run.index
    step = lambda p: None if p is None else int(idx[p])  # noqa: E731
    columns = [("request", "request", "str"), ("arrival", "arrival step", "int"), ("prompt", "prompt tokens", "int"),
               ("tokens", "generated", "int"), ("first", "first step", "int"), ("last", "last step", "int"),
               ("preemptions", "preemptions", "int"), ("cached", "prefix-cached", "int"), ("status", "status", "str")]
    data: dict[str, list] = {"request": [f.name for f in fs], "arrival": [f.arrival for f in fs],
                             "prompt": [f.prompt_len for f in fs], "tokens": [f.tokens for f in fs],
                             "first": [step(f.first) for f in fs], "last": [step(f.last) for f in fs],
                             "preemptions": [f.preemptions for f in fs], "cached": [f.cached for f in fs],
                             "status": [f.status for f in fs]}
    if extra:
        columns += [("divergences", "divergences", "int"), ("flips", "token flips", "int"),
                    ("first_step", "first divergence: step", "int"), ("first_position", "at output position", "int"),
                    ("max_delta", "max |Δlogprob|", "float"), ("flip", "first flip", "str")]
        data.update(extra)
    return {"columns": columns, "data": data, "n": len(fs)}
