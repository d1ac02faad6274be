"""Forward hooks on vLLM's own model, in every worker: the output rows of one request at one step, module by module,
and a planted fault (`--plant` on vLLM's runner).

The functions named `*_taps` run on each worker through the executor's `collective_rpc` (the model lives in the
worker processes under tensor parallelism). A hook keeps the rows of the watched request: its tokens' rows
(`query_start_loc` of its row in the persistent batch) in a per-token output, its logits rows (one, plus one per
draft it verifies) in the logits processor's. Outputs are kept as each rank computed them; `gather_ranks` then
tells a whole output (the same on every rank: after an all-reduce, or replicated) from a sharded one (a column-
parallel projection, the attention heads), and puts a sharded one back together in the unsharded order, so that a
TP=2 run compares with a TP=1 run module by module.
"""

from __future__ import annotations

from typing import Any

import msgspec

_TAPS = "_replay_taps"  # the worker's attribute that holds the installed hooks and what they kept
BATCH = "#batch"  # a plant's source that stands for the batch's size (`replay.replayer.plant`)
LOGITS = "logits_processor"  # vLLM's module that computes the logits (`lm_head` itself is never called)


class ModuleRows(msgspec.Struct):
    """One module's output rows for the watched request, put together from every rank."""

    name: str  # vLLM's module name; a module called again in the step (a shared rotary embedding) is "name#2"
    rows: Any  # torch.Tensor [rows, features], as the module computed it (dtype kept)
    gathered: bool = False  # sharded across tensor-parallel ranks and put back together here


def _model_runner(worker: Any) -> Any:
    return getattr(worker, "worker", worker).model_runner  # a WorkerWrapperBase or the worker itself


def install_taps(worker: Any, watch: str, modules: bool, plant: tuple[str, float, str] | None,
                 drafts: dict[str, int]) -> list[str]:
    """On one worker: hooks on every named module (`modules`), else on the logits processor only, keeping `watch`'s
    rows; with `plant` = (module, size, source), that module's output gets `size` added to the largest element of
    each of `watch`'s rows (every rank adds to its own output: one element where the output is whole, one per shard
    where it is sharded), or with a `source` request, `size` times the mean of the source's rows (a leak; nothing
    where the source is not in the batch), or with BATCH, `size` times the batch's token count (a fault of shape
    alone). `drafts`: the drafts each request verifies (its logits rows beyond the
    first). Returns the model's module names (the caller checks the planted one)."""
    import torch

    collect_taps(worker)  # hooks a failed step left behind
    runner = _model_runner(worker)
    named = [(n, m) for n, m in runner.get_model().named_modules() if n]
    state: dict[str, Any] = {"rows": [], "handles": [], "calls": {}, "planted": 0}
    setattr(worker, _TAPS, state)

    def span(name: str, out: torch.Tensor, rid: str = watch) -> tuple[int, int] | None:
        batch = runner.input_batch
        i = batch.req_id_to_index.get(rid)
        if i is None or out.dim() == 0:
            return None
        if name == LOGITS:
            start = i + sum(drafts.get(r, 0) for r in batch.req_ids[:i])
            return start, start + 1 + drafts.get(rid, 0)
        qsl = runner.query_start_loc.np
        if out.shape[0] < int(qsl[batch.num_reqs]):
            return None  # not one row per token (a pooled or per-request output)
        return int(qsl[i]), int(qsl[i + 1])

    def hook(name: str, module: Any, args: Any, out: Any) -> Any:
        parts = list(out) if isinstance(out, (tuple, list)) else [out]
        if not parts or not isinstance(parts[0], torch.Tensor):
            return None
        calls = state["calls"][name] = state["calls"].get(name, 0) + 1
        if name == LOGITS and calls > 1:
            return None  # prompt logprobs: logits again, over other rows
        where = span(name, parts[0])
        if where is None:
            return None
        a, b = where
        changed = None
        if plant is not None and name == plant[0]:
            first = parts[0].clone(memory_format=torch.contiguous_format)
            flat = first.view(first.shape[0], -1)
            leak = plant[2] not in ("", BATCH)
            source = span(name, parts[0], plant[2]) if leak else None
            if source is not None:
                flat[a:b] += plant[1] * flat[source[0]:source[1]].mean(dim=0)
            elif not leak:
                cols = flat[a:b].argmax(dim=1)
                flat[torch.arange(a, b, device=flat.device), cols] += plant[1] * (flat.shape[0] if plant[2] else 1)
            parts[0] = first
            state["planted"] += 1  # (the hook ran on the watched rows: a leak whose source is absent adds nothing)
            if isinstance(out, tuple) and hasattr(out, "_fields"):  # a named tuple
                changed = type(out)(*parts)
            else:
                changed = type(out)(parts) if isinstance(out, (tuple, list)) else first
        if modules or name == LOGITS:
            key = name if calls == 1 else f"{name}#{calls}"
            sizes = list(getattr(module, "output_sizes", None) or [])
            # with fewer KV heads than ranks, each KV head is copied onto `num_kv_head_replicas` consecutive ranks
            kv = getattr(module, "num_kv_head_replicas", 1) if len(sizes) == 3 else 1
            replicas = [1, kv, kv] if kv > 1 else [1] * len(sizes)
            for j, t in enumerate(parts):
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == parts[0].shape[0]:
                    rows = t.reshape(t.shape[0], -1)[a:b].detach().to("cpu").clone()
                    state["rows"].append((key if j == 0 else f"{key}[{j}]", rows, sizes if j == 0 else [],
                                          replicas if j == 0 else []))
        return changed

    for name, m in named:
        if modules or name == LOGITS or (plant is not None and name == plant[0]):
            on_output = lambda mod, args, out, name=name: hook(name, mod, args, out)  # noqa: E731
            state["handles"].append(m.register_forward_hook(on_output))
    return [n for n, _ in named]


def collect_taps(worker: Any) -> tuple[list[tuple[str, Any, list[int], list[int]]], int]:
    """On one worker: remove the hooks and hand over what they kept, in execution order ((name, rows, output_sizes
    of a merged projection and how many ranks hold a copy of each output's shard, else [] and [])), and how many
    times the planted fault was added."""
    state = getattr(worker, _TAPS, None) or {"rows": [], "handles": [], "planted": 0}
    for h in state["handles"]:
        h.remove()
    setattr(worker, _TAPS, None)
    return state["rows"], state["planted"]


def gather_ranks(per_rank: list[list[tuple]]) -> list[ModuleRows]:
    """Every module rank 0 kept, in its order: whole where every rank holds the same rows, else its shards put back
    in the unsharded column order (a merged projection, like vLLM's qkv_proj or gate_up_proj, shard by shard of each
    of its outputs; an output copied onto r consecutive ranks, as qkv_proj's K and V with fewer KV heads than ranks,
    from one rank of each r). Each rank's entries are (name, rows, output_sizes[, replicas])."""
    import torch

    others = [{name: rows for name, rows, *_ in rank} for rank in per_rank[1:]]
    out = []
    for name, rows, sizes, *rest in per_rank[0]:
        replicas = rest[0] if rest and rest[0] else [1] * len(sizes)
        shards = [rows] + [o[name] for o in others if name in o]
        if len(shards) == 1 or all(s.shape == rows.shape and torch.equal(s, rows) for s in shards[1:]):
            out.append(ModuleRows(name, rows))
            continue
        tp = len(shards)
        if sizes and all(s % tp == 0 for s in sizes) and sum(s // tp for s in sizes) == rows.shape[1]:
            pieces = [torch.split(s, [n // tp for n in sizes], dim=1) for s in shards]
            whole = torch.cat([p[k] for k in range(len(sizes)) for i, p in enumerate(pieces)
                               if i % replicas[k] == 0], dim=1)
        else:
            whole = torch.cat(shards, dim=1)
        out.append(ModuleRows(name, whole, gathered=True))
    return out


def live_requests(worker: Any) -> list[str]:
    """On one worker: the requests its model runner holds."""
    return list(_model_runner(worker).requests)
