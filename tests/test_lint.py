"""ruff over the whole repository, with the rules in pyproject.toml: the README's test command is the linter too, so
CI needs no second step."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    """The ruff of this environment (a test extra), else one on PATH."""
    here = Path(sys.executable).parent / "ruff"
    found = str(here) if here.exists() else shutil.which("ruff")
    assert found, "ruff is a test extra: pip install -e '.[test]'"
    return [found]


def test_ruff_finds_nothing():
    out = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
