"""The command lines an explanation prints to reproduce its tests."""

from __future__ import annotations

import shlex


def command_line(args: list[str], overrides: dict[str, str], from_start: bool = False) -> str:
    """A command line that reproduces a test of the explanation: its knobs (the runner among them) as `--set`."""
    args = args + [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")] + ["--from-start"] * from_start
    return " ".join(shlex.quote(a) for a in args)
