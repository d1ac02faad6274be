"""Where a tapped vLLM scheduler records: REPLAY_CAPTURE, one path per data-parallel rank and per engine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_paths_in_use: set[str] = set()  # capture paths of this process's taps: two schedulers never share a file


def capture_path(base: str | os.PathLike, scheduler: Any, ring: bool = False) -> str:
    """Where a scheduler records: REPLAY_CAPTURE as given for a single engine; with data parallelism one file per
    rank (`run.capture` -> `run.dp1.capture`); a second scheduler in one process gets `.e2`, `.e3`, ... so that one
    engine's capture never overwrites or blocks another's."""
    p = Path(base)
    default = "" if ring else ".capture"  # (a ring is a directory, named as given)
    stem, suffix = (p.name[: -len(p.suffix)], p.suffix) if p.suffix else (p.name, default)
    rank = data_parallel_rank(scheduler)
    if rank is not None:
        stem += f".dp{rank}"
    path, n = p.with_name(stem + suffix), 1
    while str(path) in _paths_in_use:
        n += 1
        path = p.with_name(f"{stem}.e{n}{suffix}")
    _paths_in_use.add(str(path))
    return str(path)


def data_parallel_rank(scheduler: Any) -> int | None:
    """This engine's data-parallel rank, None without data parallelism. vLLM runs each rank of a dense model as an
    independent engine (its parallel config says DP=1 there), naming the process EngineCore_DP<rank> and keeping the
    rank in `data_parallel_index`; a MoE model keeps data_parallel_size and data_parallel_rank."""
    import multiprocessing

    parallel = getattr(getattr(scheduler, "vllm_config", None), "parallel_config", None)
    rank = getattr(parallel, "data_parallel_index", None)
    if rank is None:
        rank = getattr(parallel, "data_parallel_rank", 0)
    if int(getattr(parallel, "data_parallel_size", 1) or 1) > 1 or \
            multiprocessing.current_process().name.startswith("EngineCore_DP"):
        return int(rank or 0)
    return None
