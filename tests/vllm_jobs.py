"""vLLM processes the tests start, run side by side.

A vLLM process spends most of its life in its own start-up (imports, model load, KV-cache set-up), single-threaded,
so on the 2-core test machine two of them finish in little more time than one. The suites that record several
independent captures start them together (`side_by_side`) and each test then checks its own run (`succeeded`).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def side_by_side(run: Callable[[str], T], names: list[str], workers: int = 2) -> dict[str, T]:
    """`run(name)` for every name, `workers` at a time; name -> its result, in the order given. Each run's output
    must go to its own pipes or files (subprocess.run with capture_output does): runs never share one."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(names, pool.map(run, names)))


@contextmanager
def beside(run: Callable[[str], T], names: list[str]) -> Iterator[Future[dict[str, T]]]:
    """`run(name)` for every name, one at a time, on a thread of its own while the caller records in its own process
    meanwhile; the future's result is name -> its result, in the order given. Leaving the block waits for them."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(lambda: {name: run(name) for name in names})


def succeeded(runs: dict[str, tuple[Path, subprocess.CompletedProcess]], name: str) -> Path:
    """The capture of run `name`, which must have exited 0 (else its stderr's end is the failure)."""
    capture, out = runs[name]
    assert out.returncode == 0, (out.stderr or out.stdout or "")[-3000:]
    return capture
