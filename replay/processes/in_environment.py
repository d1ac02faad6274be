"""`--set env.NAME=VALUE`: a replay (or a bisect's side) in an environment of its own.

An environment variable acts when a library reads it, mostly once, when it loads: MKL's `MKL_CBWR`, ATen's
`ATEN_CPU_CAPABILITY`, OpenMP's `OMP_*`, vLLM's `VLLM_*` in every worker it starts. Setting one in this process,
where torch is already loaded, would change nothing and say nothing. So work with `env.*` knobs runs in a fresh
(spawned) process started with them, and the runner's workers inherit them from it. The result comes back as the
function returned it; an error of ours comes back as itself (its class and one-line message).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from replay.errors import ReplayError, UsageError


def applied(env: dict[str, str | None]) -> bool:
    """This process already runs with `env` (None: unset)."""
    return all(os.environ.get(k) == v for k, v in env.items())


def in_environment(env: dict[str, str | None], fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a fresh process whose environment is this one's with `env` applied. `fn`, its
    arguments and its result must pickle (module-level functions, msgspec Structs, CPU tensors)."""
    with Environments() as envs:
        return envs.call(env, fn, *args, **kwargs)


class Environments:
    """Fresh processes kept by their environment: the calls of one bisect that share a setting of `env.*` knobs run
    in one process, which keeps what it started (a vLLM engine) from one call to the next. Shut down on `close`."""

    def __init__(self) -> None:
        self._pools: dict[tuple, ProcessPoolExecutor] = {}

    def call(self, env: dict[str, str | None], fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in the process of `env` (started on first use), as `in_environment` says."""
        key = tuple(sorted(env.items(), key=lambda kv: kv[0]))
        try:
            pool = self._pools.get(key) or self._start(key, env)
            status, value = pool.submit(_call, fn, args, kwargs).result()
        except BrokenProcessPool:  # killed (out of memory), or a variable it cannot run with (an ISA this CPU lacks)
            self._pools.pop(key, None)
            named = ", ".join(f"{k}={'(unset)' if v is None else v}" for k, v in env.items()) or "no variable changed"
            raise UsageError(f"the fresh process for the environment knobs ({named}) died before it answered") from None
        if status == "error":
            module, name, message, attrs = value
            cls = getattr(importlib.import_module(module), name)
            err = cls.__new__(cls)
            Exception.__init__(err, message)  # str(err) is the child's line; exit_code is the class's
            err.__dict__.update(attrs)
            raise err
        return value

    def _start(self, key: tuple, env: dict[str, str | None]) -> ProcessPoolExecutor:
        saved = {k: os.environ.get(k) for k in env}
        _apply(env)
        try:  # a spawned worker copies os.environ as it starts: start it now, with `env` applied
            pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            pool.submit(os.getpid).result()
        finally:
            _apply(saved)
        self._pools[key] = pool
        return pool

    def close(self) -> None:
        """Shut every process down (and what it started with it)."""
        while self._pools:
            self._pools.popitem()[1].shutdown()

    def __enter__(self) -> Environments:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _apply(env: dict[str, str | None]) -> None:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[str, Any]:
    """In the child: ("ok", the result), or ("error", (module, class, message, attributes)) for an error of ours
    (their constructors take more than a message, so they do not pickle as themselves)."""
    try:
        return "ok", fn(*args, **kwargs)
    except ReplayError as e:
        return "error", (type(e).__module__, type(e).__name__, str(e), dict(e.__dict__))
