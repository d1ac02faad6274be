"""Run replay from a checkout: `python cli.py ...` is the same as the installed `replay` command."""

import sys

from replay.cli import main

if __name__ == "__main__":
    sys.exit(main())
