"""The writer process's dealings with the operating system: a deep pipe, a life apart from the engine's process
tree, and its own CPU time (which, apart, the engine's rusage never counts)."""

from __future__ import annotations

import os
import signal


def grow_pipe(fd: int) -> None:
    """A deeper pipe (Linux: up to pipe-max-size, 1 MiB by default) so that a burst of steps never makes the engine
    wait for the writer process; the writer only has to keep up on average."""
    try:
        import fcntl

        with open("/proc/sys/fs/pipe-max-size") as f:
            size = min(int(f.read()), 1 << 20)
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except (OSError, ValueError, ImportError):
        pass  # another OS, or a lower limit: the default pipe works, it only waits sooner


def cpu_s() -> float:
    """This process's CPU time so far (user + system), at microsecond resolution where the OS gives it."""
    try:
        import resource

        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    except ImportError:
        t = os.times()
        return t.user + t.system


def detach() -> float:
    """Outlive the engine long enough to seal. vLLM's shutdown SIGKILLs every descendant of the EngineCore it finds
    (psutil's children, recursively), so the writer must not be one: it forks once more and the engine's own child
    exits at once, leaving the writer to init. Then a session of its own (a Ctrl-C or a kill of the engine's process
    group does not reach it) and no default handlers for the stop signals. The end of the pipe is what ends it.
    Returns the CPU time spent before the fork (imports), which the forked process's own count starts without."""
    before = cpu_s()
    if hasattr(os, "fork") and os.fork() > 0:
        os._exit(0)
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    return before if hasattr(os, "fork") else 0.0
