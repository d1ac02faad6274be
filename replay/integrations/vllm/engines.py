"""`Engines`: started vLLM engines kept for the replays of one process. Starting an engine (weights, KV cache,
warm-up) is most of a short replay, and a corpus of one layout, or a script that replays many captures, asks for the
same engine again and again. An engine is reused only for the very same engine arguments, layout, thread binding and
thread count; between two replays it forgets every request (`VllmRunner.reset`) and its workers' random generators
go back to the state they had just after the engine started, so a replay on a reused engine draws what it would have
drawn on a fresh one. The engine seed is the one argument a reuse may change: vLLM reseeds the generators as its
warm-up ends, so where they stood exactly there, reseeding them to another seed is a fresh start with it (RL
rollouts, one seed per worker, then share an engine).

Used explicitly (`with Engines() as engines: replay_capture(path, ReplayOptions(engines=engines))`, docs/guide.md):
without one, every replay starts and stops its own engine.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from replay.errors import UsageError


@dataclass(slots=True)
class StartedEngine:
    """One started engine: vLLM's `LLM`, what it said while starting, and its workers' generators right after."""

    llm: Any
    warnings: list[str] = field(default_factory=list)
    rng: list[Any] = field(default_factory=list)  # per rank, `worker_state.rng_state`
    seed: int | None = None  # the engine seed its workers' generators stand at (`VllmRunner`)
    reseedable: bool = False  # whether they stood where vLLM's `set_random_seed(seed)` puts them as it started
    replays: int = 0  # replays that ran on it
    # another engine of this process was shut down since it started: vLLM's teardown destroys the process's one
    # parallel state, which this one's in-process worker steps in ("model parallel group is not initialized")
    stale: bool = False
    beside: str = ""  # the capture it started for: what it prints as it shuts down goes to that capture's vLLM log


class Engines:
    """The started engines of one process, by their arguments (see the module docstring); at most `keep` of them,
    the least recently used shut down first (each holds a model's weights and its KV cache)."""

    def __init__(self, keep: int = 2) -> None:
        self._started: OrderedDict[str, StartedEngine] = OrderedDict()
        self.keep = max(keep, 1)
        self.starts = 0  # engines started (a reuse does not count)
        self.closed = False

    def take(self, key: str, start: Callable[[], StartedEngine],
             alone_may_help: Callable[[Exception], bool] = lambda e: True) -> tuple[StartedEngine, bool]:
        """The engine for `key`, started with `start()` if there is none yet; and whether it was just started.
        `alone_may_help(e)`: whether a start that failed with `e` beside the engines held may succeed alone (False
        for a configuration the engine refuses anyway: the engines held then stay)."""
        if self.closed:
            raise UsageError("this Engines pool is closed: open another (`with Engines() as engines:`)")
        engine = self._started.get(key)
        if engine is not None and engine.stale:
            # it cannot step any more, and its teardown would only stale the others again: let it go as it is
            del self._started[key]
            _ALIVE.remove(engine)
            engine = None
        if engine is not None:
            self._started.move_to_end(key)
            engine.replays += 1
            return engine, False
        while len(self._started) >= self.keep:
            shutdown(self._started.popitem(last=False)[1])
        try:
            engine = start()
        except Exception as e:
            if not self._started or not alone_may_help(e):
                raise
            # vLLM keeps one parallel state per process, set up by the first engine: one started beside it may
            # find it wanting (an MoE model's expert-parallel group, beside a dense model's engine). Alone, it starts.
            self._shut_all()
            engine = start()
        engine.replays = 1
        _ALIVE.append(engine)
        self._started[key] = engine
        self.starts += 1
        return engine, True

    def held(self) -> list[StartedEngine]:
        """The engines it holds now, the least recently used first."""
        return list(self._started.values())

    def discard(self, engine: StartedEngine) -> None:
        """Shut `engine` down and forget it: it failed in a way a reset cannot vouch for, and the next replay of its
        arguments starts a fresh one."""
        for key, held in list(self._started.items()):
            if held is engine:
                del self._started[key]
        shutdown(engine)

    def close(self) -> None:
        """Shut every engine down (KV caches, weights, worker processes); the pool starts none after."""
        self.closed = True
        self._shut_all()

    def _shut_all(self) -> None:
        while self._started:
            shutdown(self._started.popitem()[1])

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_PROCESS: Engines | None = None
_ALIVE: list[StartedEngine] = []  # every engine of this process's pools not shut down yet


def process_engines(keep: int = 2) -> Engines:
    """This process's own pool, for the calls sent to a process of their own (`replay.processes.in_environment
    .Environments`, `check --jobs N`'s workers): it keeps their engines from one call to the next, and shuts them
    down as the process exits. `keep`: how many it holds, set by the process's first call."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = Engines(keep)
        atexit.register(_PROCESS.close)
        # in a multiprocessing worker the finalizers run before it joins its own children (vLLM's workers), and
        # a forked one never runs atexit
        multiprocessing.util.Finalize(None, _PROCESS.close, exitpriority=10)
    return _PROCESS


def shut_down_beside() -> None:
    """An engine of this process was shut down (a pool's, a replay's own, `replay record --engine vllm`'s): its
    teardown took the process's parallel state with it, so every pooled engine whose worker steps in this process is
    stale (`StartedEngine.stale`), and the next replay of its arguments starts a fresh one. Workers of their own
    (tensor parallelism) keep theirs."""
    for engine in _ALIVE:
        if _steps_here(engine):
            engine.stale = True


def _steps_here(engine: StartedEngine) -> bool:
    """Whether `engine`'s worker runs in this process (vLLM's UniProcExecutor), not in processes of its own."""
    try:
        return hasattr(engine.llm.llm_engine.engine_core.engine_core.model_executor, "driver_worker")
    except AttributeError:  # (an engine of another shape: stale is only slower)
        return True


def release(llm: Any) -> None:
    """Shut a vLLM `LLM` of this process down, best effort (what it ran is over), and mark what its teardown broke
    (`shut_down_beside`): every engine shut down in this process goes through here."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort: its work is over
        pass
    shut_down_beside()


def shutdown(engine: StartedEngine) -> None:
    """Shut `engine` down (`release`), what vLLM prints meanwhile into its capture's log."""
    from replay.integrations.vllm.logs import VllmLog

    if engine in _ALIVE:
        _ALIVE.remove(engine)
    try:
        with VllmLog(engine.beside or "replay", ".vllm-replay.log"):  # (never on stdout: a --json result may follow)
            release(engine.llm)
    except OSError:  # the log could not be opened: shut it down all the same
        release(engine.llm)
