"""Fanning independent replays out: in this process, in local worker processes (`--jobs N`), or as Ray tasks on a
cluster (`--ray`: the one at `RAY_ADDRESS` or `--ray-address`, else a local single-node one).

Each task is a module-level function of one picklable argument that returns a picklable result (msgspec Structs
are); results come back as they finish, with the index of their argument, so a caller can stream them into a
results file and an interrupted run loses only what was in flight. Local workers are spawned, never forked: a
forked child would inherit torch's thread pools and any vLLM engine in this process.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from replay.errors import CannotTestError, UsageError


@dataclass(frozen=True, slots=True)
class FanOut:
    """Where tasks run: `jobs` local processes (1: in this process), or Ray when `ray` is set."""

    jobs: int = 1
    ray: bool = False
    ray_address: str | None = None  # None: RAY_ADDRESS if set, else a local single-node cluster

    def describe(self) -> str:
        """'serial' | '2 local processes' | 'Ray (local single-node cluster)' ..."""
        if self.ray:
            where = self.ray_address or os.environ.get("RAY_ADDRESS") or "a local single-node cluster"
            return f"Ray ({where})"
        return "serial" if self.jobs <= 1 else f"{self.jobs} local processes"


def fan_out(fn: Callable[[Any], Any], args: list[Any], how: FanOut,
            resources: Callable[[Any], dict[str, float]] | None = None) -> Iterator[tuple[int, Any]]:
    """(index, fn(args[index])) for every argument, in the order they finish. `resources(arg)`: what one Ray task
    needs ({"num_cpus": 1} or {"num_gpus": 1, ...}); local processes ignore it. An exception `fn` raises is
    re-raised here: callers give `fn` its own error handling when one failure must not end the run."""
    if how.jobs < 1:
        raise UsageError(f"--jobs {how.jobs}: expected at least 1")
    if how.ray:
        yield from _on_ray(fn, args, how, resources)
    elif how.jobs == 1 or len(args) <= 1:
        for i, a in enumerate(args):
            yield i, fn(a)
    else:
        yield from _in_processes(fn, args, how.jobs)


def _in_processes(fn: Callable[[Any], Any], args: list[Any], jobs: int) -> Iterator[tuple[int, Any]]:
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(max_workers=min(jobs, len(args)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        pending = {pool.submit(fn, a): i for i, a in enumerate(args)}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    yield pending.pop(f), f.result()
        except BrokenProcessPool:
            raise CannotTestError(
                f"a worker process of --jobs {jobs} died before it answered: killed (out of memory?), or a script "
                "that fans out without `if __name__ == \"__main__\":` (each spawned worker re-runs the script)"
            ) from None
        finally:  # interrupted (Ctrl-C, a consumer that stopped): do not start what was still queued
            for f in pending:
                f.cancel()


class _DefaultAuthNotice(logging.Filter):
    """Ray's notice that the local node it starts has token authentication on (its default since Ray 2.60), which
    its own stderr handler prints beside our one-line errors: dropped. Ray's other warnings (authentication off, a
    token missing) still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.funcName != "_warn_token_auth_enabled"


def _quiet_default_auth_notice() -> None:
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DefaultAuthNotice) for f in log.filters):
        log.addFilter(_DefaultAuthNotice())


def _on_ray(fn: Callable[[Any], Any], args: list[Any], how: FanOut,
            resources: Callable[[Any], dict[str, float]] | None) -> Iterator[tuple[int, Any]]:
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray installed (pip install 'ray[default]')") from None
    address = how.ray_address or os.environ.get("RAY_ADDRESS") or None
    if not ray.is_initialized():
        _quiet_default_auth_notice()
        try:
            with warnings.catch_warnings():  # (a client that cannot connect warns, then raises: the raise is said)
                warnings.simplefilter("ignore", UserWarning)
                ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        except Exception as e:  # noqa: BLE001 - no cluster at that address, a version mismatch: one line
            raise UsageError(f"--ray: cannot join a Ray cluster at {address or 'a new local node'}: "
                             f"{type(e).__name__}: {e}"[:400]) from None
    task = ray.remote(fn)
    refs = {}
    for i, a in enumerate(args):
        opts = dict(resources(a)) if resources else {"num_cpus": 1}
        refs[task.options(**opts, max_retries=0).remote(a)] = i
    try:
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            for ref in done:
                yield refs.pop(ref), ray.get(ref)
    finally:
        for ref in refs:  # interrupted: do not leave the cluster working for nobody
            ray.cancel(ref)
