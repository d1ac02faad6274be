"""The `replay` command: parse, call one library function, render, map errors to exit codes (docs/design.md, "Errors").

Results go to stdout, diagnostics to stderr. Every error is one line (`replay: <file>: <problem>`), never a traceback
(`replay -v` shows it). Exit codes: 0 ok, 1 divergence / nothing recoverable, 2 usage or unreadable input, 3 completed
on a damaged capture, 125 cannot test.
"""

from __future__ import annotations

import os
import sys

from typer.exceptions import Abort, Exit, TyperException

from replay.cli import (  # noqa: F401  (they register commands)
    bisect_cmds,
    inspect_cmds,
    record_cmds,
    replay_cmds,
    report_cmds,
    trainer_cmds,
)
from replay.cli.common import VERBOSE_ENV, app, err
from replay.errors import EXIT_CANNOT_TEST, EXIT_OK, EXIT_USAGE

__all__ = ["app", "main", "run"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `replay` console script. Returns the exit code."""
    verbose_before = os.environ.get(VERBOSE_ENV)  # `-v` sets it for this command (and what it starts) only
    try:
        return _main(argv)
    finally:
        if verbose_before is None:
            os.environ.pop(VERBOSE_ENV, None)
        else:
            os.environ[VERBOSE_ENV] = verbose_before


def _main(argv: list[str] | None) -> int:
    try:
        rc = app(args=argv, prog_name="replay", standalone_mode=False)
    except Exit as e:
        return e.exit_code
    except Abort:
        err("aborted")
        return 130
    except TyperException as e:  # typer's (vendored click) usage errors: one line, exit 2
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `replay` or `replay CMD`: show the help
            print(e.format_message(), file=sys.stderr)
        else:
            err(e.format_message() if hasattr(e, "format_message") else str(e))
        if _command(e) == "check":  # under `git bisect run`, 2 would mark a commit that lacks a flag bad
            return EXIT_CANNOT_TEST
        return getattr(e, "exit_code", EXIT_USAGE) or EXIT_USAGE
    return rc if isinstance(rc, int) else EXIT_OK


def _command(e: TyperException) -> str:
    """The subcommand a usage error is about ("" for `replay` itself)."""
    ctx = getattr(e, "ctx", None)
    return ctx.info_name if ctx is not None and ctx.parent is not None else ""


def run() -> None:
    """Console-script wrapper: exit with `main()`'s code."""
    sys.exit(main())


if __name__ == "__main__":
    run()
