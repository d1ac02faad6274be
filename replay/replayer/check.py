"""`check_capture`: the `git bisect run` predicate (`replay check`): 0 replays within tolerance, 1 diverges,
125 cannot test."""

from __future__ import annotations

import os

from replay.errors import EXIT_CANNOT_TEST, EXIT_DIVERGED, EXIT_OK, ReplayError
from replay.replayer.run import ReplayOptions, replay_capture


def check_capture(path: str | os.PathLike, opts: ReplayOptions | None = None) -> int:
    """`git bisect run` predicate: 0 replays within tolerance, 1 diverges, 125 cannot test."""
    try:
        report = replay_capture(path, opts)
    except ReplayError:
        return EXIT_CANNOT_TEST
    except Exception:  # noqa: BLE001 - an engine that fails to start cannot be tested, whatever the reason
        return EXIT_CANNOT_TEST
    return EXIT_DIVERGED if report.diverged else EXIT_OK
