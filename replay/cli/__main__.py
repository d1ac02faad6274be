"""`python -m replay.cli ...` is the `replay` command."""

from replay.cli import run

run()
